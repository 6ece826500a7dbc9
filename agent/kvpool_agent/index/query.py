"""What a query asks: the chunk keys of one prompt, and what it gets: matches per node.

A gateway sends token ids with the request's ``cache_salt`` and the model's
:class:`~kvpool_agent.keys.ModelFingerprint`; the keys are derived exactly as
the connector derives them (:mod:`kvpool_agent.keys`), lazily, so a search
that stops at a miss hashes no further. The salt only seeds the chain and is
not kept. A caller that already has the keys passes them instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvpool_agent.index.tracker import KeyChain
from kvpool_agent.keys import ModelFingerprint, iter_chunk_keys, root_key


class PromptKeys:
    """The chain keys of a prompt's full chunks, each hashed on first access."""

    __slots__ = ("_chain", "_keys", "_length")

    def __init__(
        self, token_ids: Sequence[int], salt: str | None, fingerprint: ModelFingerprint
    ) -> None:
        self._length = len(token_ids) // fingerprint.chunk_tokens
        self._chain: Iterator[bytes] = iter_chunk_keys(
            token_ids, root_key(salt, fingerprint), fingerprint.chunk_tokens
        )
        self._keys: list[bytes] = []

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, position: int) -> bytes:
        keys = self._keys
        if 0 <= position < len(keys):
            return keys[position]
        if not 0 <= position < self._length:
            raise IndexError(f"chunk {position} of a prompt of {self._length} chunks")
        while len(keys) <= position:
            keys.append(next(self._chain))
        return keys[position]

    @property
    def hashed(self) -> int:
        """Keys computed so far."""
        return len(self._keys)


@dataclass(frozen=True)
class Query:
    keys: KeyChain
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
