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
* ``s_i = SHA-256("kvpool-state-v1\0" || k_i)``: the record of the state that state-space
  (Mamba) and linear-attention layers have after chunk ``i`` (:func:`state_key`), for
  models that have such layers; stored under the chunk's tenant, with ``k_i`` as parent.

Two salts never share a root, so they never share a key: tenant isolation
rests on SHA-256 preimage resistance, not on the agent's bookkeeping.

A *structured* salt shares a prompt's first tokens with the other tenants admitted to a
shared space (:func:`shared_salt`, :func:`plan_salt`)::

    kvpool-share-v1;space=<space salt>;shared=<tokens>;tenant=<tenant salt>

with both salts percent-encoded (RFC 3986: every byte but ``A-Za-z0-9-._~``). With
``b = shared // chunk_tokens`` (a boundary inside a chunk rounds down), chunks ``[0, b)``
chain from ``root(space salt)`` under ``tenant_id(space salt)``; the first private chunk
mixes in the tenant's own root, ``k_b = SHA-256(k_{b-1} || root(tenant salt) ||
tokens_b)``, and the chain goes on as usual under ``tenant_id(tenant salt)``. With
``b = 0`` the keys are those of the plain tenant salt. So every private key depends on the
tenant's salt: no private chunk matches another tenant's, whatever the tokens. A string
that starts with ``kvpool-share-`` but does not parse is never taken as a plain salt: its
``tenant=`` alone when that parses, else no cache for the request (:class:`SaltPlan`).

A ``cache_salt``, plain or structured, has at most :data:`MAX_SALT_CHARS` (4096) characters:
a longer one gets no cache for the request, before any of it is read, so that no request
stalls the scheduler that parses it for every tenant of the engine (the structured form is
parsed in one pass). The operator's generated salts have 43; two salts of up to 512 bytes
each fit in a structured one at any bytes (percent-encoding takes up to 3 characters a
byte).
"""

from __future__ import annotations

import hashlib
import re
import sys
import urllib.parse
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

KEY_BYTES = 32
TENANT_ID_CHARS = 32

_TENANT_DOMAIN = b"kvpool-tenant-v1\0"
_ROOT_DOMAIN = b"kvpool-root-v1\0"
_STATE_DOMAIN = b"kvpool-state-v1\0"
_TAIL_DOMAIN = b"kvpool-tail-v1\0"
_CANARY_SCOPE_DOMAIN = b"kvpool-doctor-canary-scope-v1\0"


CANARY_TENANT = hashlib.sha256(b"kvpool-doctor-canary-v1").hexdigest()[:TENANT_ID_CHARS]
"""The tenant of ``kvpool doctor``'s canary chunks: a digest in a domain of its own, so no
salt maps to it (that would take a 128-bit SHA-256 preimage). Its chunks stay in L1 (the
write-back skips them) and the doctor clears them at once. Every chunk token may use it, so
it is no store for anyone: its chunks are :data:`CANARY_CHUNK_BYTES` each, its quota is
:data:`CANARY_QUOTA_BYTES` whatever the pool's, and the agent keeps each session's chunks
under keys of that session's own (:func:`canary_key`)."""
CANARY_CHUNK_BYTES = 4096
"""The size of every canary chunk, the smallest page: a canary chunk holds one page."""
CANARY_QUOTA_BYTES = 64 * CANARY_CHUNK_BYTES
"""The canary tenant's fixed quota (256 KiB: 64 chunks, 64 pages of L1)."""


def canary_key(scope: bytes, key: bytes) -> bytes:
    """The key the agent keeps a canary chunk named ``key`` under, in a session's ``scope``
    (random bytes of its own): a session finds only the canary chunks it stored."""
    return hashlib.sha256(_CANARY_SCOPE_DOMAIN + scope + key).digest()


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


def state_key(chunk_key: bytes) -> bytes:
    """``s_i``: the key of the state-space layers' state at the end of the chunk ``k_i``."""
    return hashlib.sha256(_STATE_DOMAIN + chunk_key).digest()


def tail_key(previous: bytes, tail_tokens: Sequence[int]) -> bytes:
    """``t = H("tail" || k_{F-1} || tokens[F*C:N])``: the key of a prompt's last partial
    chunk (the tokens after its ``F`` full chunks), chained on the last full chunk's key (the
    root's, for a prompt shorter than a chunk), so it keeps the chain's salt and model
    separation, and two prompts that differ anywhere have different tails."""
    hasher = hashlib.sha256(_TAIL_DOMAIN + previous)
    hasher.update(_pack(tail_tokens))
    return hasher.digest()


def next_key(previous: bytes, chunk_tokens: Sequence[int]) -> bytes:
    """``k_i = H(k_{i-1} || tokens_i)``."""
    hasher = hashlib.sha256(previous)
    hasher.update(_pack(chunk_tokens))
    return hasher.digest()


MAX_SALT_CHARS = 4096
"""The longest ``cache_salt`` that keys anything (see the module docstring)."""
SALT_TOO_LONG = f"cache_salt longer than {MAX_SALT_CHARS} characters, the most one may have"
SHARE_PREFIX = "kvpool-share-"
"""What starts every structured salt (of any version): such a string is never a plain salt."""
SHARE_VERSION = "kvpool-share-v1"
_SHARE_FIELDS = ("space", "shared", "tenant")
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,9}")
_PERCENT_ENCODED = re.compile(r"[A-Za-z0-9._~-]*(?:%[0-9A-Fa-f]{2}[A-Za-z0-9._~-]*)*")
"""Unreserved characters and %XX escapes, matched in one pass (no alternative per character)."""


def shared_salt(space_salt: str, shared_tokens: int, tenant_salt: str | None) -> str:
    """The structured ``cache_salt`` of a request whose first ``shared_tokens`` tokens belong
    to the shared space of ``space_salt`` and the rest to the tenant of ``tenant_salt``."""
    if not space_salt:
        raise ValueError("a shared space's salt must not be empty")
    if shared_tokens < 0:
        raise ValueError(f"shared tokens must be 0 or more, not {shared_tokens}")
    space = urllib.parse.quote(space_salt, safe="")
    tenant = urllib.parse.quote(tenant_salt or "", safe="")
    return f"{SHARE_VERSION};space={space};shared={shared_tokens};tenant={tenant}"


@dataclass(frozen=True)
class SaltPlan:
    """Whose keys a request's chunks are: what its ``cache_salt`` means (:func:`plan_salt`)."""

    tenant_salt: str | None
    """The salt of the request's own (private) chunks."""
    space_salt: str | None = None
    """The shared space's salt: chunks before the boundary are keyed under it."""
    shared_tokens: int = 0
    problem: str | None = None
    """Why the salt was not taken as written, a structured one that does not parse or one too
    long (the request is then the tenant's alone, or gets no cache when ``cacheable`` is
    false)."""
    cacheable: bool = True

    def shared_chunks(self, chunk_tokens: int) -> int:
        """Chunks keyed under the space (the boundary rounds down to a chunk edge)."""
        return self.shared_tokens // chunk_tokens if self.space_salt is not None else 0

    def chain(self, chunk_tokens: int, root: Callable[[str | None], bytes]) -> KeyChain:
        """The key chain of a request under this plan; ``root(salt)``: the chain seed of a
        salt for the model (:func:`root_key`, maybe memoized)."""
        return KeyChain(*self.seed(chunk_tokens, root))

    def seed(
        self, chunk_tokens: int, root: Callable[[str | None], bytes]
    ) -> tuple[bytes, int, tuple[int, bytes] | None]:
        """What :meth:`chain` builds its :class:`KeyChain` from: the chain's root, the chunk
        size and the mix (a structured salt's first private chunk and the tenant's root).
        Enough to go on hashing a chain without keeping the salt (the index's follower of
        vLLM's KV events keeps this per block chain)."""
        shared = self.shared_chunks(chunk_tokens)
        if shared == 0:
            return root(self.tenant_salt), chunk_tokens, None
        return root(self.space_salt), chunk_tokens, (shared, root(self.tenant_salt))


def plan_salt(salt: str | None) -> SaltPlan:
    """What a vLLM ``cache_salt`` means for the keys (see the module docstring)."""
    if salt is not None and len(salt) > MAX_SALT_CHARS:
        return SaltPlan(None, problem=SALT_TOO_LONG, cacheable=False)
    if salt is None or not salt.startswith(SHARE_PREFIX):
        return SaltPlan(salt)
    fields, problem = _share_fields(salt)
    if problem is None:
        try:
            space = _decoded(fields["space"], "space")
            tenant = _decoded(fields["tenant"], "tenant")
        except ValueError as error:
            problem = str(error)
        else:
            if not space:
                problem = "the space's salt is empty"
            else:
                return SaltPlan(tenant, space, int(fields["shared"]))
    try:
        alone: str | None = _decoded(fields["tenant"], "tenant") if "tenant" in fields else None
    except ValueError:
        alone = None
    if alone is None:
        return SaltPlan(None, problem=f"{problem}; no tenant= either", cacheable=False)
    return SaltPlan(alone, problem=problem)


def _share_fields(salt: str) -> tuple[dict[str, str], str | None]:
    """The fields of a structured salt, and what is wrong with it (None: nothing)."""
    version, _, rest = salt.partition(";")
    fields: dict[str, str] = {}
    problem: str | None = None
    for part in rest.split(";") if rest else []:
        name, equals, value = part.partition("=")
        if not equals or name not in _SHARE_FIELDS:
            problem = problem or f"unknown field {name[:16]!r}; expected {list(_SHARE_FIELDS)}"
        elif name in fields:
            problem = problem or f"field {name!r} given twice"
        else:
            fields[name] = value
    if version != SHARE_VERSION:
        return fields, f"unknown version {version[:24]!r}; this connector reads {SHARE_VERSION}"
    missing = [name for name in _SHARE_FIELDS if name not in fields]
    if problem is None and missing:
        problem = f"missing fields {missing}"
    if problem is None and not _DECIMAL.fullmatch(fields["shared"]):
        problem = "shared= must be a decimal token count"
    return fields, problem


def _decoded(value: str, name: str) -> str:
    """A percent-encoded salt; ValueError unless every reserved character was encoded."""
    if not _PERCENT_ENCODED.fullmatch(value):
        raise ValueError(f"{name}= is not percent-encoded")
    try:
        return urllib.parse.unquote(value, errors="strict")
    except UnicodeDecodeError:
        raise ValueError(f"{name}= is not UTF-8 once decoded") from None


def chunk_keys(
    token_ids: Sequence[int], salt: str | None, fingerprint: ModelFingerprint
) -> list[bytes]:
    """Keys of every *full* chunk of ``token_ids``; a trailing partial chunk has no key.
    ``salt`` may be structured (:func:`plan_salt`); one that does not parse keys nothing."""
    plan = plan_salt(salt)
    if not plan.cacheable:
        return []
    chain = plan.chain(fingerprint.chunk_tokens, lambda salt: root_key(salt, fingerprint))
    return chain.upto(token_ids, len(token_ids) // fingerprint.chunk_tokens)


class KeyChain:
    """The chained keys of one token sequence's full chunks, each hashed on first need.

    The connector's scheduler keeps one per request and rank while the request grows, the
    index one per query: a lookup that stops at a miss hashes no further, and a key is
    hashed once. ``tokens`` may only grow between calls.
    """

    __slots__ = ("_chunk_tokens", "_keys", "_mix", "_root")

    def __init__(
        self, root: bytes, chunk_tokens: int, mix: tuple[int, bytes] | None = None
    ) -> None:
        """``mix``: (chunk, material) hashed into that chunk's key between the previous key
        and the tokens (a structured salt's first private chunk and the tenant's root)."""
        self._root = root
        self._chunk_tokens = chunk_tokens
        self._keys: list[bytes] = []
        self._mix = mix

    @property
    def chunk_tokens(self) -> int:
        return self._chunk_tokens

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
        mix_at, mix = self._mix if self._mix is not None else (-1, b"")
        for batch in range(len(keys), end, _PACK_CHUNKS):
            packed = _pack(tokens[batch * size : min(batch + _PACK_CHUNKS, end) * size])
            for start in range(0, len(packed), size):
                hasher = hashlib.sha256(key)
                if batch + start // size == mix_at:
                    hasher.update(mix)
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
        """The key before chunk ``chunk`` (hashed already), None for the first chunk and for
        the first private chunk of a structured salt (its parent is the space's)."""
        if chunk <= 0 or (self._mix is not None and chunk == self._mix[0]):
            return None
        return self._keys[chunk - 1]
