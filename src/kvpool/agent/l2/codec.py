"""L2 objects: a header, then the payload, sealed or authenticated under the pool's key.

Layout (little-endian)::

    magic "KVPL2" | format version u8 | flags u8 | key id u32 | chunk key[32]
    | tenant[32] | payload length u64 | nonce[24] | tag[16] | body

The body is the payload, AES-256-GCM ciphertext where the tier seals (flag
``SEALED``), else plaintext. Either way the tag is AES-GCM's over the header
up to the tag (the associated data: chunk key, tenant, length, format, flags,
key id) and the body, so an object opens only as the chunk it was written for,
in the pool it was written in, by a holder of the pool's key. A forged, renamed,
truncated or tampered object, one from another pool or under a key id this
agent does not hold is an :class:`IntegrityError` (a miss), never bytes.

Keys: the tenant's key is HKDF-SHA256 of the master key (its id in the header),
with the pool and the tenant id as info; each object's key is HKDF-Expand of
the tenant's key with the first 12 bytes of the object's random 24-byte nonce,
and AES-GCM's nonce is the other 12. Nonces come from the OS's CSPRNG, so
agents writing the same chunk need no coordination: a (key, nonce) pair repeats
only if 192 random bits do, and no single AES key is used for more than one
object, far inside GCM's limits however many objects a tenant writes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
from collections.abc import Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import AEADEncryptionContext, Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from kvpool.agent.l2.base import ObjectKey
from kvpool.agent.l2.buffers import BufferPool
from kvpool.common.keyring import Keyring

MAGIC = b"KVPL2"
FORMAT_VERSION = 2
SEALED = 0x01
HEADER = struct.Struct("<5sBBI32s32sQ24s16s")
TAG_SIZE = 16
NONCE_SIZE = 24
_ASSOCIATED = HEADER.size - TAG_SIZE
"""The header up to the tag: the associated data."""
_LENGTH_FIELD = 6


class IntegrityError(ValueError):
    """The bytes are not the object that was asked for (or not intact, or not ours)."""


def payload_length(header: bytes | memoryview) -> int:
    """The payload length a header states (0 if it is shorter than a header)."""
    return int(HEADER.unpack_from(header)[_LENGTH_FIELD]) if len(header) >= HEADER.size else 0


class ObjectCodec:
    """Encodes a tier's objects (sealed or not) and opens any object of the pool's keys."""

    def __init__(self, keyring: Keyring, pool: str, *, seal: bool, buffers: BufferPool) -> None:
        self.keyring = keyring
        self.seal = seal
        self.buffers = buffers
        self._pool = pool.encode()

    @contextlib.contextmanager
    def encode(
        self, name: ObjectKey, payload: bytes | memoryview, key_id: int | None = None
    ) -> Iterator[tuple[bytes, bytes | memoryview]]:
        """The header and the body of ``payload`` as ``name``, for the block's duration.

        The body is the payload itself where the tier does not seal (no copy), its
        ciphertext in a buffer borrowed from :attr:`buffers` where it does. ``key_id``: one
        the reader holds (a peer's), else the active key.
        """
        associated, cipher = self._encryptor(name, len(payload), key_id)
        if not self.seal:
            cipher.authenticate_additional_data(payload)
            cipher.finalize()
            yield associated + cipher.tag, payload
            return
        with self.buffers.borrow(len(payload)) as body:
            cipher.update_into(payload, body)
            cipher.finalize()
            yield associated + cipher.tag, body

    def encode_into(
        self, name: ObjectKey, payload: bytes | memoryview, out: memoryview, key_id: int
    ) -> None:
        """The object of ``payload`` as ``name`` (its header, then its body) into ``out``,
        ``HEADER.size`` bytes longer than the payload: sealed from the payload into it, or
        copied there and authenticated where it lies."""
        associated, cipher = self._encryptor(name, len(payload), key_id)
        body = out[HEADER.size :]
        if self.seal:
            cipher.update_into(payload, body)
        else:
            body[:] = payload
            cipher.authenticate_additional_data(body)
        cipher.finalize()
        out[: HEADER.size] = associated + cipher.tag

    def _encryptor(
        self, name: ObjectKey, length: int, key_id: int | None
    ) -> tuple[bytes, AEADEncryptionContext]:
        """A new object's associated data (its header without the tag) and its cipher, the
        associated data authenticated."""
        keys = self.keyring.current()
        if key_id is None:
            key_id = keys.active_id
        nonce = os.urandom(NONCE_SIZE)
        flags = SEALED if self.seal else 0
        associated = HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            flags,
            key_id,
            name.key,
            name.tenant.encode(),
            length,
            nonce,
            bytes(TAG_SIZE),
        )[:_ASSOCIATED]
        cipher = self._cipher(keys.by_id[key_id], name.tenant, nonce, None).encryptor()
        cipher.authenticate_additional_data(associated)
        return associated, cipher

    def decode(
        self, name: ObjectKey, blob: bytes | memoryview, *, in_place: bool = False
    ) -> bytes | memoryview:
        """The payload of a whole object; :class:`IntegrityError` unless it opens as ``name``."""
        view = memoryview(blob)
        return self.open(name, view[: HEADER.size], view[HEADER.size :], in_place=in_place)

    def open(
        self,
        name: ObjectKey,
        header: bytes | memoryview,
        body: bytes | memoryview,
        *,
        in_place: bool = False,
        out: memoryview | None = None,
    ) -> bytes | memoryview:
        """The payload of ``header`` and ``body``, read apart; :class:`IntegrityError` unless
        they open as ``name``.

        A plaintext body comes back as it is (no copy). A sealed one is decrypted into new
        bytes, with ``in_place`` (a writable body the caller owns) where it lies, or into
        ``out`` (as long as the body). With ``out``, a plaintext body is copied there too.
        """
        if len(header) < HEADER.size:
            raise IntegrityError("shorter than the object header")
        magic, version, flags, key_id, key, tenant, length, nonce, tag = HEADER.unpack_from(header)
        if magic != MAGIC:
            raise IntegrityError("not a kvpool L2 object")
        if version != FORMAT_VERSION:
            raise IntegrityError(f"object format {version}; this build reads {FORMAT_VERSION}")
        if key != name.key or tenant.rstrip(b"\0") != name.tenant.encode():
            raise IntegrityError("the object belongs to another key or tenant")
        if len(body) != length:
            raise IntegrityError(f"body of {len(body)} bytes, header says {length}")
        material = self.keyring.current().by_id.get(key_id)
        if material is None:
            raise IntegrityError(f"sealed under key id {key_id}, which this agent does not hold")
        cipher = self._cipher(material, name.tenant, nonce, tag).decryptor()
        cipher.authenticate_additional_data(bytes(header[:_ASSOCIATED]))
        payload: bytes | memoryview
        if not flags & SEALED:
            cipher.authenticate_additional_data(body)
            payload = body
            if out is not None:
                out[:] = body
                payload = out
        elif out is not None:
            cipher.update_into(body, out)
            payload = out
        elif in_place:
            payload = memoryview(body)
            cipher.update_into(payload, payload)
        else:
            payload = cipher.update(body)
        try:
            cipher.finalize()
        except InvalidTag:
            raise IntegrityError(
                "authentication failed: another pool's key, a renamed copy, or tampered bytes"
            ) from None
        return payload

    def _cipher(
        self, material: bytes, tenant: str, nonce: bytes, tag: bytes | None
    ) -> Cipher[modes.GCM]:
        object_key = HKDFExpand(hashes.SHA256(), 32, b"kvpool-l2 object " + nonce[:12]).derive(
            _tenant_key(material, self._pool, tenant.encode())
        )
        return Cipher(algorithms.AES(object_key), modes.GCM(nonce[12:], tag))


@functools.lru_cache(maxsize=4096)
def _tenant_key(material: bytes, pool: bytes, tenant: bytes) -> bytes:
    info = b"kvpool-l2 tenant " + pool + b"\0" + tenant
    return HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(material)
