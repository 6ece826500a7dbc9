"""Chunk keys and tenant ids: the one place that decides what may be shared.

Both the connector (inside vLLM) and tools import this module, so a key is the
same in every process and every vLLM version. The scheme, documented so that
tenants can reproduce it:

* ``tenant_id(salt) = hex(SHA-256("kvpool-tenant-v1\\0" || salt))[:32]``.
  One-way: the agent only ever sees this id, never the salt.
* ``root = SHA-256("kvpool-root-v1\\0" || salt || "\\0" || fingerprint)``, where
  the fingerprint names the model, dtype, KV layout, tensor-parallel rank and
  chunk size (see :class:`ModelFingerprint`).
* ``k_i = SHA-256(k_{i-1} || tokens_i)`` over the i-th full chunk of token ids,
  each token a little-endian uint32, with ``k_{-1} = root``.

Two salts never share a root, so they never share a key: tenant isolation
rests on SHA-256 preimage resistance, not on the agent's bookkeeping.
"""

from __future__ import annotations

import hashlib
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

KEY_BYTES = 32
TENANT_ID_CHARS = 32

_TENANT_DOMAIN = b"kvpool-tenant-v1\0"
_ROOT_DOMAIN = b"kvpool-root-v1\0"


CANARY_TENANT = hashlib.sha256(b"kvpool-doctor-canary-v1").hexdigest()[:TENANT_ID_CHARS]
"""The tenant of ``kvpool doctor``'s canary chunks: a digest in a domain of its own, so no
salt maps to it (that would take a 128-bit SHA-256 preimage). Its chunks stay in L1 (the
write-back skips them) and the doctor clears them at once."""


def tenant_id(salt: str | None) -> str:
    """The tenant id for a vLLM ``cache_salt`` (``None`` and ``""`` are the default tenant)."""
    digest = hashlib.sha256(_TENANT_DOMAIN + (salt or "").encode())
    return digest.hexdigest()[:TENANT_ID_CHARS]


TENANT_ID_PATTERN = rf"^[0-9a-f]{{{TENANT_ID_CHARS}}}$"
"""A tenant id as a JSON Schema / OpenAPI pattern."""
_TENANT_ID = re.compile(TENANT_ID_PATTERN)
TENANT_ID_RULE = (
    f"tenant id must be {TENANT_ID_CHARS} lowercase hex characters; "
    "compute it with `kvpool tenant-id`"
)


def is_tenant_id(value: str) -> bool:
    """True for a well-formed tenant id (see :func:`tenant_id`)."""
    return _TENANT_ID.fullmatch(value) is not None


def check_tenant_id(value: str) -> str:
    """Return ``value`` if it is a well-formed tenant id; ValueError with the rule if not."""
    if not is_tenant_id(value):
        raise ValueError(TENANT_ID_RULE)
    return value


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that makes two engines' KV bytes for the same tokens differ."""

    model: str
    dtype: str
    kv_layout: str
    tp_rank: int = 0
    tp_size: int = 1
    chunk_tokens: int = 256

    def encode(self) -> bytes:
        fields = (
            self.model,
            self.dtype,
            self.kv_layout,
            str(self.tp_rank),
            str(self.tp_size),
            str(self.chunk_tokens),
        )
        return "\x1f".join(fields).encode()


_TOKEN_BYTES = 4
_PACK_CHUNKS = 16
"""Chunks of token ids packed at a time (:meth:`KeyChain.extend`)."""


def _pack(token_ids: Sequence[int]) -> array[int]:
    """Token ids as little-endian uint32s (``fromlist``: a list packs ~30% faster)."""
    if isinstance(token_ids, list):
        tokens = array("I")
        tokens.fromlist(token_ids)
    else:
        tokens = array("I", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


def root_key(salt: str | None, fingerprint: ModelFingerprint) -> bytes:
    """The chain seed ``k_{-1}`` for one tenant and one model configuration."""
    material = _ROOT_DOMAIN + (salt or "").encode() + b"\0" + fingerprint.encode()
    return hashlib.sha256(material).digest()


def next_key(previous: bytes, chunk_tokens: Sequence[int]) -> bytes:
    """``k_i = H(k_{i-1} || tokens_i)``."""
    hasher = hashlib.sha256(previous)
    hasher.update(_pack(chunk_tokens))
    return hasher.digest()


def chunk_keys(
    token_ids: Sequence[int], salt: str | None, fingerprint: ModelFingerprint
) -> list[bytes]:
    """Keys of every *full* chunk of ``token_ids``; a trailing partial chunk has no key."""
    chain = KeyChain(root_key(salt, fingerprint), fingerprint.chunk_tokens)
    return chain.upto(token_ids, len(token_ids) // fingerprint.chunk_tokens)


class KeyChain:
    """The chained keys of one token sequence's full chunks, each hashed on first need.

    The connector's scheduler keeps one per request and rank while the request grows, the
    index one per query: a lookup that stops at a miss hashes no further, and a key is
    hashed once. ``tokens`` may only grow between calls.
    """

    __slots__ = ("_chunk_tokens", "_keys", "_root")

    def __init__(self, root: bytes, chunk_tokens: int) -> None:
        self._root = root
        self._chunk_tokens = chunk_tokens
        self._keys: list[bytes] = []

    @property
    def keys(self) -> Sequence[bytes]:
        """The keys hashed so far, in chunk order."""
        return self._keys

    def extend(self, tokens: Sequence[int], chunks: int) -> int:
        """Hash the keys of the first ``chunks`` full chunks of ``tokens`` that are not hashed
        yet (fewer where ``tokens`` has fewer); the number of keys hashed so far.

        The token ids are packed a batch of chunks at a time and each key hashes a slice of
        that buffer: a batch stays in the CPU's cache, where a long prompt packed at once
        would not (about 20% faster on a 32k-token prompt).
        """
        keys, size = self._keys, self._chunk_tokens
        end = min(chunks, len(tokens) // size)
        key = keys[-1] if keys else self._root
        for batch in range(len(keys), end, _PACK_CHUNKS):
            packed = _pack(tokens[batch * size : min(batch + _PACK_CHUNKS, end) * size])
            for start in range(0, len(packed), size):
                hasher = hashlib.sha256(key)
                hasher.update(packed[start : start + size])
                key = hasher.digest()
                keys.append(key)
        return len(keys)

    def upto(self, tokens: Sequence[int], chunks: int) -> list[bytes]:
        """The keys of the first ``chunks`` full chunks of ``tokens`` (fewer where it has
        fewer)."""
        if chunks > len(self._keys):
            self.extend(tokens, chunks)
        return self._keys[:chunks]

    def parent(self, chunk: int) -> bytes | None:
        """The key before chunk ``chunk`` (hashed already), None for the first chunk."""
        return self._keys[chunk - 1] if chunk > 0 else None
