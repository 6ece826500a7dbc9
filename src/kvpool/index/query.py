"""What a query asks: the chunk keys of one prompt, and what it gets: matches per node.

A gateway sends token ids with the request's ``cache_salt`` and the model's
:class:`~kvpool.common.keys.ModelFingerprint`; the keys are derived exactly as
the connector derives them (:mod:`kvpool.common.keys`), lazily, so a search
that stops at a miss hashes no further. The salt only seeds the chain and is
not kept; a structured salt (a shared space's prefix, then the tenant's) keys each
part as the connector does, and one that gives no tenant matches nothing. A caller
that already has the keys passes them instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.common.keys import ModelFingerprint, plan_salt, root_key
from kvpool.index.tracker import KeySequence


class PromptKeys:
    """The chain keys of a prompt's full chunks, as a sequence: each hashed on first access
    (by a :class:`~kvpool.common.keys.KeyChain`, as the connector hashes them)."""

    __slots__ = ("_chain", "_length", "_tokens")

    def __init__(
        self, token_ids: Sequence[int], salt: str | None, fingerprint: ModelFingerprint
    ) -> None:
        plan = plan_salt(salt)
        self._tokens = token_ids
        self._length = len(token_ids) // fingerprint.chunk_tokens if plan.cacheable else 0
        self._chain = plan.chain(fingerprint.chunk_tokens, lambda seed: root_key(seed, fingerprint))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, position: int) -> bytes:
        if not 0 <= position < self._length:
            raise IndexError(f"chunk {position} of a prompt of {self._length} chunks")
        keys = self._chain.keys
        if position >= len(keys):
            self._chain.extend(self._tokens, position + 1)
        return keys[position]

    def head(self, length: int) -> list[bytes]:
        """The first ``length`` keys, hashed, as a list (what a tracker reads fastest)."""
        if length > 0:
            self[length - 1]
        return self._chain.keys[:length]  # type: ignore[return-value]  # a list's slice

    @property
    def hashed(self) -> int:
        """Keys computed so far."""
        return len(self._chain.keys)


@dataclass(frozen=True)
class Query:
    keys: KeySequence
    prompt_tokens: int
    """Length of the prompt in tokens (a trailing partial chunk counts, though it has no key)."""
    chunk_tokens: int

    @classmethod
    def of_tokens(
        cls, token_ids: Sequence[int], salt: str | None, fingerprint: ModelFingerprint
    ) -> Query:
        return cls(
            PromptKeys(token_ids, salt, fingerprint), len(token_ids), fingerprint.chunk_tokens
        )

    @classmethod
    def of_keys(cls, keys: Sequence[bytes], chunk_tokens: int) -> Query:
        return cls(list(keys), len(keys) * chunk_tokens, chunk_tokens)


@dataclass(frozen=True, slots=True)
class NodeMatch:
    node: str
    chunks: int
    """Leading chunks of the prompt the node holds."""
    tokens: int
    """The same in tokens: ``chunks * chunk_tokens``."""
    last_seen: float
    """Unix time the last matched chunk was seen stored (or listed by a resync)."""
