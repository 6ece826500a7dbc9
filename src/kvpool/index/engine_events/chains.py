"""One model server's GPU prefix cache, from vLLM's block events to kvpool chunk keys.

vLLM names a cached block by a hash of its parent's hash, its tokens and its extra keys
(the request's ``cache_salt`` on the first block). kvpool names a chunk of
``chunk_tokens`` tokens by a SHA-256 chain from a root derived from the salt and the
model's fingerprint (:mod:`kvpool.common.keys`). The picker hashes a prompt once, into
kvpool keys, so the GPU tier is kept in kvpool keys too: :class:`ServerChains` follows the
server's block chains (``parent_block_hash`` links; each block's tokens) and, whenever a
chain's blocks complete a chunk (every ``chunk_tokens`` tokens from the start), hashes that
chunk's key with :class:`~kvpool.common.keys.KeyChain`, seeded as
:class:`~kvpool.index.query.PromptKeys` seeds it. ``chunk_tokens`` must be a multiple of
the block size (events of blocks that do not divide it are skipped).

**What is kept per block** (never the salt): its parent's hash, where it ends (tokens from
the request's start), its tokens (packed uint32s: a chunk's key needs all of its blocks'
tokens, and a chain can branch inside a chunk, so a block keeps them while it is
remembered), the chain's seed (the root and the structured salt's mix, derived once from
the first block's salt and shared by every block of the chain), the key of the chunk
before its own, the key it completes (if it ends a chunk), and which chunk ends depend on
it: about 500 bytes a block at vLLM's 16-token blocks, the tracker's entries included.
A chunk is *held* while every one of its blocks is stored; a server holds a key while at
least one of its block paths holds it.

**Tenants.** The keys derive from the salt, so a request with another salt never matches
a server's blocks of this one. vLLM hashes the whole ``cache_salt`` string, while kvpool
keys a shared space's chunks (a structured salt, :func:`~kvpool.common.keys.plan_salt`)
under the space: two tenants of one space give the same space keys from different vLLM
blocks, and a server holding the space's prefix for tenant A counts for tenant B too.
vLLM itself would recompute that prefix for B (its hashes differ), but the node's L1 has
it: the picker's estimate is off by the GPU-versus-L1 cost, never a tenant boundary.

**Removal.** ``BlockRemoved`` marks a block absent and releases every chunk through it;
the block is kept as a ghost (its tokens and key state), so that a chain whose middle was
evicted still places its later blocks when they are stored again. ``AllBlocksCleared``
forgets everything. Blocks are capped per server (``max_blocks``): the oldest stored go
first, and a present block that goes releases its chunks (an entry the index cannot map
back from a later ``BlockRemoved`` is dropped rather than left stale).

**Not placed** (counted): blocks whose parent is unknown (the index joined late, or the
parent was capped out), LoRA blocks (``lora_name``/``lora_id``: the adapter is another
model identity than the fingerprint), multimodal or prompt-embedding blocks (their tokens
are placeholders, kvpool keys token ids only), blocks of KV-cache groups other than 0
(hybrid models report one group per attention kind; only group 0 is followed, so for
them the GPU tier may promise more than vLLM reuses, which needs every group to hit),
media other than the GPU (vLLM's offloading connectors report CPU/STORAGE copies), and a
first block whose salt kvpool would not key (too long, or a malformed structured salt).

Thread safety: none; one follower thread owns a server's chains.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from kvpool.common.keys import KeyChain, ModelFingerprint, plan_salt, root_key
from kvpool.index.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored, Event

DEFAULT_MAX_BLOCKS = 100_000
"""Blocks remembered per server (about 50 MB): 1.6M tokens at vLLM's 16-token blocks, more
than most GPUs hold; a server that holds more is under-reported (its oldest blocks go),
never over-reported."""
GPU_MEDIA = (None, "GPU", "gpu")

Hash = int | bytes


ChunkBlocks = Callable[[bytes, Sequence[Hash], "Hash | None", int], None]
"""Told a chunk's vLLM blocks once its key is known: ``(key, block hashes first to last,
the first one's parent, block size)`` (the placement events name chunks by them)."""


class ChunkSink(Protocol):
    """Where held chunks go (:class:`~kvpool.index.tracker.PrefixTracker`)."""

    def stored(self, node: str, keys: Sequence[bytes]) -> None: ...

    def removed(self, node: str, keys: Iterable[bytes]) -> None: ...

    def drop_node(self, node: str) -> None: ...


@dataclass(frozen=True, slots=True)
class _Seed:
    """A chain's start: what its salt derives, not the salt."""

    root: bytes
    mix: tuple[int, bytes] | None


class _Block:
    __slots__ = ("before", "end", "ends", "key", "parent", "present", "seed", "tokens", "whole")

    def __init__(
        self, parent: Hash | None, end: int, seed: _Seed, before: bytes | None, tokens: array[int]
    ) -> None:
        self.parent = parent
        self.end = end
        """Tokens from the request's start through this block."""
        self.seed = seed
        self.before = before
        """Key of the chunk before this block's chunk (None: it is in the first chunk)."""
        self.tokens = tokens
        self.key: bytes | None = None
        """The key of the chunk this block ends, once hashed."""
        self.whole = False
        """This block ends a chunk whose blocks are all present: it counts for ``key``."""
        self.ends: list[Hash] = []
        """Blocks ending a chunk through this one (with this one if it ends one)."""
        self.present = True


class _Skip(Enum):
    UNPLACED = "unplaced"
    SKIPPED = "skipped"


@dataclass
class ChainCounts:
    unplaced: int = 0
    """Blocks whose parent is unknown."""
    skipped: int = 0
    """Blocks not followed: LoRA, multimodal, another group or medium, an unkeyed salt, a
    block size that does not divide the chunk."""
    capped: int = 0
    """Blocks forgotten because the server was over its cap."""
    clears: int = 0
    """``AllBlocksCleared`` events (vLLM's prefix cache was reset)."""


class ServerChains:
    """One server's blocks and the kvpool chunks they hold, written to ``sink`` under
    ``node`` (the server's address)."""

    def __init__(
        self,
        node: str,
        fingerprint: ModelFingerprint,
        sink: ChunkSink,
        *,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        root: Callable[[str | None], bytes] | None = None,
        on_chunk: ChunkBlocks | None = None,
    ) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.node = node
        self._chunk_tokens = fingerprint.chunk_tokens
        self._root = root or (lambda salt: root_key(salt, fingerprint))
        self._sink = sink
        self._on_chunk = on_chunk
        self._max_blocks = max_blocks
        self._blocks: OrderedDict[Hash, _Block] = OrderedDict()
        self._held: dict[bytes, int] = {}
        self._present = 0
        self.counts = ChainCounts()

    @property
    def blocks(self) -> int:
        """Blocks present (stored and not removed) now."""
        return self._present

    @property
    def chunks(self) -> int:
        """Distinct chunk keys held now."""
        return len(self._held)

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            if event.medium in GPU_MEDIA and event.group_idx in (None, 0):
                self._removed(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.counts.clears += 1
            self.clear()

    def clear(self) -> None:
        """Forget everything: the server's cache is gone or no longer known."""
        self._blocks.clear()
        self._held.clear()
        self._present = 0
        self._sink.drop_node(self.node)

    # ----------------------------------------------------------------- stored

    def _stored(self, event: BlockStored) -> None:
        count = len(event.block_hashes)
        size = event.block_size
        if (
            event.medium not in GPU_MEDIA
            or event.group_idx not in (None, 0)
            or event.lora_name is not None
            or event.lora_id is not None
            or self._chunk_tokens % size
            or len(event.token_ids) != count * size
            or (event.extra_keys is not None and len(event.extra_keys) != count)
        ):
            self.counts.skipped += count
            return
        extras: Sequence[Any] = event.extra_keys or [None] * count
        tokens = array("I", event.token_ids)
        newly: list[bytes] = []
        parent = event.parent_block_hash
        for index, block_hash in enumerate(event.block_hashes):
            placed = self._place(
                block_hash, parent, tokens[index * size : (index + 1) * size], extras[index]
            )
            if isinstance(placed, _Skip):
                # the rest of the event chains from this block: not followed either
                rest = count - index
                if placed is _Skip.UNPLACED:
                    self.counts.unplaced += rest
                else:
                    self.counts.skipped += rest
                break
            newly.extend(placed)
            parent = block_hash
        if newly:
            self._sink.stored(self.node, newly)
        self._trim()

    def _place(
        self, block_hash: Hash, parent: Hash | None, tokens: array[int], extra: Any
    ) -> list[bytes] | _Skip:
        """Store one block; the keys it makes held (in chain order), or why it is not placed."""
        known = self._blocks.get(block_hash)
        if known is not None:
            self._blocks.move_to_end(block_hash)
            if not known.present:
                known.present = True
                self._present += 1
            return self._recheck(known)
        if parent is None:
            seed = self._seed(extra)
            if seed is None:
                return _Skip.SKIPPED
            block = _Block(None, len(tokens), seed, None, tokens)
        else:
            previous = self._blocks.get(parent)
            if previous is None or (
                previous.end % self._chunk_tokens == 0 and previous.key is None
            ):
                return _Skip.UNPLACED
            if extra is not None:  # only a first block carries plain extras (the salt)
                return _Skip.SKIPPED
            before = previous.key if previous.end % self._chunk_tokens == 0 else previous.before
            block = _Block(parent, previous.end + len(tokens), previous.seed, before, tokens)
        self._blocks[block_hash] = block
        self._present += 1
        if block.end % self._chunk_tokens:
            return []
        block.ends.append(block_hash)
        return self._recheck(block)

    def _seed(self, extra: Any) -> _Seed | None:
        """The seed of a chain from its first block's extra keys; None if it is not followed."""
        salt: str | None = None
        for item in extra or ():
            if not isinstance(item, str) or salt is not None:
                return None  # multimodal, prompt embeddings, or more than one string
            salt = item
        plan = plan_salt(salt)
        if not plan.cacheable:
            return None
        root, _, mix = plan.seed(self._chunk_tokens, self._root)
        return _Seed(root, mix)

    def _recheck(self, block: _Block) -> list[bytes]:
        """Make every chunk end through ``block`` whole where all its blocks are present."""
        held: list[bytes] = []
        for end_hash in block.ends:
            end = self._blocks.get(end_hash)
            if end is None or end.whole:
                continue
            members = self._members(end)
            if members is None:
                continue
            if end.key is None:
                end.key = self._hash(end, members)
                for member in members:
                    if end_hash not in member.ends:
                        member.ends.append(end_hash)
                if self._on_chunk is not None:
                    hashes = [member.parent for member in members[1:]]
                    self._on_chunk(
                        end.key,
                        [*(h for h in hashes if h is not None), end_hash],
                        members[0].parent,
                        len(end.tokens),
                    )
            if not all(member.present for member in members):
                continue
            end.whole = True
            if self._acquire(end.key):
                held.append(end.key)
        return held

    def _members(self, end: _Block) -> list[_Block] | None:
        """The blocks of the chunk ``end`` ends, first to last; None if one is forgotten or
        they do not start where the chunk starts."""
        start = end.end - self._chunk_tokens
        members = [end]
        block = end
        while block.end - len(block.tokens) > start:
            if block.parent is None:
                return None
            parent = self._blocks.get(block.parent)
            if parent is None:
                return None
            members.append(parent)
            block = parent
        if block.end - len(block.tokens) != start:
            return None  # a block straddles the chunk's start (block sizes changed mid-chain)
        members.reverse()
        return members

    def _hash(self, end: _Block, members: list[_Block]) -> bytes:
        chunk = end.end // self._chunk_tokens - 1
        seed = end.seed
        mix = (0, seed.mix[1]) if seed.mix is not None and seed.mix[0] == chunk else None
        chain = KeyChain(end.before or seed.root, self._chunk_tokens, mix)
        tokens = array("I")
        for member in members:
            tokens.extend(member.tokens)
        chain.extend(tokens, 1)
        return chain.keys[0]

    def _acquire(self, key: bytes) -> bool:
        """Count one more path holding ``key``; True if the server did not hold it."""
        self._held[key] = self._held.get(key, 0) + 1
        return self._held[key] == 1

    # ---------------------------------------------------------------- removed

    def _removed(self, hashes: Iterable[Hash]) -> None:
        gone: list[bytes] = []
        for block_hash in hashes:
            block = self._blocks.get(block_hash)
            if block is None or not block.present:
                continue
            block.present = False
            self._present -= 1
            gone.extend(self._release(block))
        if gone:
            self._sink.removed(self.node, gone)

    def _release(self, block: _Block) -> list[bytes]:
        """Chunk ends through ``block`` are no longer whole; the keys no path holds now."""
        gone: list[bytes] = []
        for end_hash in block.ends:
            end = self._blocks.get(end_hash)
            if end is None or not end.whole or end.key is None:
                continue
            end.whole = False
            left = self._held[end.key] - 1
            if left:
                self._held[end.key] = left
            else:
                del self._held[end.key]
                gone.append(end.key)
        return gone

    def _trim(self) -> None:
        gone: list[bytes] = []
        while len(self._blocks) > self._max_blocks:
            _, block = self._blocks.popitem(last=False)
            self.counts.capped += 1
            if block.present:
                block.present = False
                self._present -= 1
                gone.extend(self._release(block))
        if gone:
            self._sink.removed(self.node, gone)
