"""L2 objects: a header, then the payload, sealed or authenticated under the pool's key.

Layout of format 2 (little-endian)::

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

Format 3 seals the body with AEGIS-128L (:mod:`kvpool.agent.l2.aegis`) instead, for the
peer tier's wire where both ends read it (at the speed of a copy on CPUs without VAES,
where AES-GCM runs at less than half of it). Its header differs only at its end: a
16-byte nonce and AEGIS's 32-byte tag, over the same associated data::

    ... | payload length u64 | nonce[16] | tag[32] | body

Its key is HKDF-Expand of the tenant's key (16 bytes); its nonce is random, so a (key,
nonce) pair repeats only if 128 random bits do: at 2^48 objects of one tenant, with a
probability under 2^-32, AEGIS's bound for random nonces. An object that is not sealed
carries AEGIS's tag over its body under a key bound to its header (HKDF-Expand of the
tenant's AEGIS key with the header as info). Every build that writes format 3 reads
both, and the peer tier writes it only for an asker that says it reads it
(:class:`~kvpool.agent.peer.wire.Prove`).
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

from kvpool.agent.l2 import aegis
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
AEGIS_FORMAT_VERSION = 3
AEGIS_HEADER = struct.Struct(f"<5sBBI32s32sQ{aegis.NONCE_SIZE}s{aegis.TAG_SIZE}s")
_AEGIS_ASSOCIATED = AEGIS_HEADER.size - aegis.TAG_SIZE
_COMMON = struct.Struct("<5sBBI32s32sQ")
"""What both formats' headers start with, up to the payload length."""
PREFIX_SIZE = 6
"""The magic and the format version: enough to know a header's size."""
MAX_HEADER_SIZE = max(HEADER.size, AEGIS_HEADER.size)


class IntegrityError(ValueError):
    """The bytes are not the object that was asked for (or not intact, or not ours)."""


def header_size(prefix: bytes | memoryview) -> int:
    """The size of the header that starts with ``prefix`` (:data:`PREFIX_SIZE` bytes or
    more): format 3's, else format 2's (whose opening says what else is wrong)."""
    if len(prefix) >= PREFIX_SIZE and prefix[PREFIX_SIZE - 1] == AEGIS_FORMAT_VERSION:
        return AEGIS_HEADER.size
    return HEADER.size


def opens_in_one_read(header: bytes | memoryview) -> bool:
    """Whether the object of ``header`` opens (:meth:`ObjectCodec.open` with ``out``) in
    one read of its body, checking the bytes it writes: a sealed format 3 object (AEGIS
    absorbs the plaintext it produces). So it may open from memory another party can
    write meanwhile (a NIXL landing): bytes changed under it are a miss, never loaded."""
    return (
        len(header) > PREFIX_SIZE
        and header_size(header) == AEGIS_HEADER.size
        and bool(header[PREFIX_SIZE] & SEALED)
    )


def payload_length(header: bytes | memoryview) -> int:
    """The payload length a header states (0 if it is shorter than a header)."""
    if len(header) < header_size(header):
        return 0
    return int(_COMMON.unpack_from(header)[-1])


class ObjectCodec:
    """Encodes a tier's objects (sealed or not) and opens any object of the pool's keys."""

    def __init__(
        self,
        keyring: Keyring,
        pool: str,
        *,
        seal: bool,
        buffers: BufferPool,
        aegis: bool = False,
    ) -> None:
        """``aegis``: write format 3 (AEGIS-128L) rather than 2 (AES-GCM)."""
        self.keyring = keyring
        self.seal = seal
        self.aegis = aegis
        self.buffers = buffers
        self.header_size = AEGIS_HEADER.size if self.aegis else HEADER.size
        """The size of the headers it writes."""
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
        if self.aegis:
            tag = bytearray(aegis.TAG_SIZE)
            if not self.seal:
                yield self._write_aegis(name, payload, payload, tag, key_id) + tag, payload
                return
            with self.buffers.borrow(len(payload)) as body:
                yield self._write_aegis(name, payload, body, tag, key_id) + tag, body
            return
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
        :attr:`header_size` bytes longer than the payload: sealed from the payload into it,
        or copied there and authenticated where it lies."""
        body = out[self.header_size :]
        if self.aegis:
            if not self.seal:
                body[:] = payload
            tag = out[_AEGIS_ASSOCIATED : self.header_size]
            out[:_AEGIS_ASSOCIATED] = self._write_aegis(name, payload, body, tag, key_id)
            return
        associated, cipher = self._encryptor(name, len(payload), key_id)
        if self.seal:
            cipher.update_into(payload, body)
        else:
            body[:] = payload
            cipher.authenticate_additional_data(body)
        cipher.finalize()
        out[: HEADER.size] = associated + cipher.tag

    def _write_aegis(
        self,
        name: ObjectKey,
        payload: bytes | memoryview,
        body: bytes | memoryview,
        tag: bytearray | memoryview,
        key_id: int | None,
    ) -> bytes:
        """A format 3 object of ``payload``: sealed into ``body``, or (integrity) its tag
        computed over ``body``, where the payload lies already. The tag goes into ``tag``;
        the header's associated data (all of it but the tag) is returned."""
        key_id, material = self._writing_key(key_id)
        nonce = os.urandom(aegis.NONCE_SIZE)
        associated = self._associated(
            AEGIS_HEADER, AEGIS_FORMAT_VERSION, key_id, name, len(payload), nonce=nonce
        )
        key = _aegis_key(material, self._pool, name.tenant.encode())
        if self.seal:
            aegis.seal_into(key, nonce, associated, payload, out=body, tag=tag)
        else:
            aegis.tag_into(_tag_key(key, associated), nonce, body, tag=tag)
        return associated

    def _encryptor(
        self, name: ObjectKey, length: int, key_id: int | None
    ) -> tuple[bytes, AEADEncryptionContext]:
        """A new format 2 object's associated data (its header without the tag) and its
        cipher, the associated data authenticated."""
        key_id, material = self._writing_key(key_id)
        nonce = os.urandom(NONCE_SIZE)
        associated = self._associated(HEADER, FORMAT_VERSION, key_id, name, length, nonce=nonce)
        cipher = self._cipher(material, name.tenant, nonce, None).encryptor()
        cipher.authenticate_additional_data(associated)
        return associated, cipher

    def _writing_key(self, key_id: int | None) -> tuple[int, bytes]:
        """The key id a new object names (``key_id``, else the active one) and its material."""
        keys = self.keyring.current()
        if key_id is None:
            key_id = keys.active_id
        return key_id, keys.by_id[key_id]

    def _associated(
        self,
        header: struct.Struct,
        version: int,
        key_id: int,
        name: ObjectKey,
        length: int,
        *,
        nonce: bytes,
    ) -> bytes:
        flags = SEALED if self.seal else 0
        tenant = name.tenant.encode()
        tag = bytes(header.size - len(nonce) - _COMMON.size)
        packed = header.pack(MAGIC, version, flags, key_id, name.key, tenant, length, nonce, tag)
        return packed[: header.size - len(tag)]

    def decode(
        self, name: ObjectKey, blob: bytes | memoryview, *, in_place: bool = False
    ) -> bytes | memoryview:
        """The payload of a whole object; :class:`IntegrityError` unless it opens as ``name``."""
        view = memoryview(blob)
        size = header_size(view)
        return self.open(name, view[:size], view[size:], in_place=in_place)

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
        if len(header) < header_size(header):
            raise IntegrityError("shorter than the object header")
        magic, version = header[: len(MAGIC)], header[len(MAGIC)]
        if magic != MAGIC:
            raise IntegrityError("not a kvpool L2 object")
        if version == AEGIS_FORMAT_VERSION:
            return self._open_aegis(name, header, body, in_place=in_place, out=out)
        if version != FORMAT_VERSION:
            raise IntegrityError(
                f"object format {version}; this build reads {FORMAT_VERSION} and "
                f"{AEGIS_FORMAT_VERSION}"
            )
        _, _, flags, key_id, key, tenant, length, nonce, tag = HEADER.unpack_from(header)
        material = self._material(name, key_id, key, tenant, length=length, body=body)
        cipher = self._cipher(material, name.tenant, nonce, tag).decryptor()
        cipher.authenticate_additional_data(bytes(header[:_ASSOCIATED]))
        payload: bytes | memoryview
        if not flags & SEALED:
            payload = body
            if out is not None:  # the tag is checked on the copy: the bytes that stay
                out[:] = body
                payload = out
            cipher.authenticate_additional_data(payload)
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
            raise _forged() from None
        return payload

    def _open_aegis(
        self,
        name: ObjectKey,
        header: bytes | memoryview,
        body: bytes | memoryview,
        *,
        in_place: bool,
        out: memoryview | None,
    ) -> bytes | memoryview:
        _, _, flags, key_id, key, tenant, length, nonce, tag = AEGIS_HEADER.unpack_from(header)
        material = self._material(name, key_id, key, tenant, length=length, body=body)
        key = _aegis_key(material, self._pool, name.tenant.encode())
        associated = bytes(header[:_AEGIS_ASSOCIATED])
        payload: bytes | memoryview
        if flags & SEALED:
            if out is None:
                out = memoryview(body) if in_place else memoryview(bytearray(len(body)))
            payload, opened = out, aegis.open_into(key, nonce, associated, body, tag, out=out)
        else:
            payload = body
            if out is not None:  # the tag is checked on the copy: the bytes that stay
                out[:] = body
                payload = out
            opened = aegis.tag_matches(_tag_key(key, associated), nonce, payload, tag)
        if not opened:
            raise _forged()
        return payload

    def _material(
        self,
        name: ObjectKey,
        key_id: int,
        key: bytes,
        tenant: bytes,
        *,
        length: int,
        body: bytes | memoryview,
    ) -> bytes:
        """The key material of ``key_id``, once the header's name and length are checked."""
        if key != name.key or tenant.rstrip(b"\0") != name.tenant.encode():
            raise IntegrityError("the object belongs to another key or tenant")
        if len(body) != length:
            raise IntegrityError(f"body of {len(body)} bytes, header says {length}")
        material = self.keyring.current().by_id.get(key_id)
        if material is None:
            raise IntegrityError(f"sealed under key id {key_id}, which this agent does not hold")
        return material

    def _cipher(
        self, material: bytes, tenant: str, nonce: bytes, tag: bytes | None
    ) -> Cipher[modes.GCM]:
        object_key = HKDFExpand(hashes.SHA256(), 32, b"kvpool-l2 object " + nonce[:12]).derive(
            _tenant_key(material, self._pool, tenant.encode())
        )
        return Cipher(algorithms.AES(object_key), modes.GCM(nonce[12:], tag))


def _forged() -> IntegrityError:
    return IntegrityError(
        "authentication failed: another pool's key, a renamed copy, or tampered bytes"
    )


@functools.lru_cache(maxsize=4096)
def _tenant_key(material: bytes, pool: bytes, tenant: bytes) -> bytes:
    info = b"kvpool-l2 tenant " + pool + b"\0" + tenant
    return HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(material)


@functools.lru_cache(maxsize=4096)
def _aegis_key(material: bytes, pool: bytes, tenant: bytes) -> bytes:
    return HKDFExpand(hashes.SHA256(), aegis.KEY_SIZE, b"kvpool-l2 aegis-128l").derive(
        _tenant_key(material, pool, tenant)
    )


def _tag_key(key: bytes, associated: bytes) -> bytes:
    """A format 3 object's key for a tag alone: bound to its header (AEGIS-128L
    authenticates the body as associated data under it, with the header's nonce)."""
    return HKDFExpand(
        hashes.SHA256(), aegis.KEY_SIZE, b"kvpool-l2 aegis-128l tag " + associated
    ).derive(key)
