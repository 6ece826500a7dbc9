"""vLLM's KV cache tensors, understood from their shapes and strides, and our chunk format.

vLLM hands the worker one tensor per attention layer. What matters for copying
is where its *blocks* are (the unit the scheduler's block ids address) and
what one block's data (its *page*) looks like. :func:`detect_layout` finds them
from the shape and the strides alone, not from the attention backend's name:

* the block dimension is the one whose size is the manager's block count, or a
  multiple of it when vLLM splits each block into kernel blocks (those are then
  grouped back, ``(num_blocks * r) -> (num_blocks, r)``); dimension 0 wins a tie,
  as in vLLM's standardized ``[B, H, N, C]`` per-layer views;
* the page is everything else, in the tensor's logical dimension order; the
  strides say whether a page (and a run of pages) is one contiguous range of
  memory, which only decides how fast the copy is, never what it produces.

Chunk byte layout (one chunk = one agent key = ``chunk_tokens`` tokens of every
layer of this worker, every KV cache group vLLM gives it)::

    chunk = group 0 | group 1 | ... | group G-1              (vLLM's group order)
    group = layer 0 | layer 1 | ... | layer L-1              (the group's layer order)
    layer = page(block nb-kept) | ... | page(block nb-1)     (token order)
    page  = one block's data, C-contiguous in the logical page shape, e.g. [H, N, C]

A group keeps the blocks a request needs to resume at the chunk's end, and no more
(:class:`GroupRule`): every block for full attention and MLA, the last
``ceil((W - 1 + R) / block_size)`` for a sliding window of ``W`` tokens (``R``: tokens vLLM
retains past the window for speculative decoding). One key holds every
group, so a hit is all of them or none: a request never resumes with one group loaded
and another not.

State-space and linear-attention groups (``state``) are not in a chunk: vLLM keeps their
state only at some block boundaries, so the state at a chunk's end is a *state record* of
its own, in the same layout with one block per group (``state group 0 | ... ``, each
``layer 0 | ... | layer L-1`` of one page), under the chunk's state key; the connector
loads a hit's chunks and its state record together or fails the request.

No padding and no header: ``chunk_bytes = sum(L * kept * prod(page_shape) * itemsize)``.
The bytes do not depend on the physical order of the tensor (an NHD engine and
an HND engine of the same model write identical chunks). What a page's bytes
*mean* is the attention backend's business (the CPU backend stores K rows then
V rows per head, for instance), so :meth:`ChunkFormat.descriptor` names the
backend as the content kind; the descriptor, part of every key's fingerprint, also
names each group's kind, layers, kept blocks and page, so engines whose layouts differ
never share a key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

STANDARD_DIM_NAMES = "BHNC"
"""vLLM's standardized per-layer view: blocks, heads, tokens in block, content."""
FORMAT_VERSION = "kvpool-chunk-v1"
GROUPS_FORMAT_VERSION = "kvpool-chunk-v2"


class LayoutError(ValueError):
    """A KV cache tensor whose blocks cannot be told apart."""


@dataclass(frozen=True)
class BlockLayout:
    """One layer's cache seen as ``[num_blocks, *page_shape]``."""

    num_blocks: int
    block_dim: int
    """The tensor dimension that indexes blocks."""
    split: int
    """Kernel blocks per manager block (1 when vLLM does not split blocks)."""
    page_shape: tuple[int, ...]
    dtype: torch.dtype
    physical_order: str
    """The tensor's dimensions from the largest stride to the smallest, e.g. ``BHNC``."""
    page_contiguous: bool
    """One block's page is a single run of memory."""
    blocks_adjacent: bool
    """Consecutive blocks follow each other in memory (a run of blocks is one range)."""

    @property
    def page_elements(self) -> int:
        return math.prod(self.page_shape)

    @property
    def page_bytes(self) -> int:
        return self.page_elements * self.dtype.itemsize

    def blocks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as ``[num_blocks, *page_shape]`` (a view, no copy)."""
        view = tensor.movedim(self.block_dim, 0)
        if self.split > 1:
            view = view.view(self.num_blocks, self.split, *view.shape[1:])
        return view


def detect_layout(tensor: torch.Tensor, num_blocks: int) -> BlockLayout:
    """Find the block dimension and the page of one layer's KV cache tensor."""
    if tensor.ndim < 2:
        raise LayoutError(f"a KV cache tensor needs a block dimension and a page: {tensor.shape}")
    candidates = [
        dim
        for dim, size in enumerate(tensor.shape)
        if size >= num_blocks and size % num_blocks == 0
    ]
    if not candidates:
        raise LayoutError(f"no dimension of {tuple(tensor.shape)} holds {num_blocks} blocks")
    if 0 in candidates:
        block_dim = 0
    elif len(candidates) == 1:
        block_dim = candidates[0]
    else:
        raise LayoutError(
            f"dimensions {candidates} of {tuple(tensor.shape)} could each hold {num_blocks} "
            "blocks; cannot tell which one does"
        )
    split = tensor.shape[block_dim] // num_blocks
    layout = BlockLayout(
        num_blocks=num_blocks,
        block_dim=block_dim,
        split=split,
        page_shape=(),
        dtype=tensor.dtype,
        physical_order=_physical_order(tensor, block_dim),
        page_contiguous=False,
        blocks_adjacent=False,
    )
    blocks = layout.blocks(tensor)
    page_shape = tuple(blocks.shape[1:])
    return BlockLayout(
        num_blocks=num_blocks,
        block_dim=block_dim,
        split=split,
        page_shape=page_shape,
        dtype=tensor.dtype,
        physical_order=layout.physical_order,
        page_contiguous=blocks[0].is_contiguous(),
        blocks_adjacent=blocks.is_contiguous(),
    )


def _physical_order(tensor: torch.Tensor, block_dim: int) -> str:
    if tensor.ndim == len(STANDARD_DIM_NAMES) and block_dim == 0:
        names = list(STANDARD_DIM_NAMES)
    else:
        names = [f"d{dim}" for dim in range(tensor.ndim)]
        names[block_dim] = "B"
    strides = tensor.stride()
    by_stride = sorted(range(tensor.ndim), key=lambda dim: (-strides[dim], dim))
    return "".join(names[dim] for dim in by_stride)


NULL_BLOCK = 0
"""The block id vLLM gives positions a group keeps no KV for (its block pool's first block,
the null block): outside a sliding window, before a local-attention chunk."""


@dataclass(frozen=True)
class GroupRule:
    """What one KV cache group needs of a chunk for a request to resume at the chunk's end.

    * ``full``: every block (full attention, MLA);
    * ``window``: the blocks of the last ``tokens`` tokens (a sliding window of ``W`` looks
      back ``W - 1`` tokens; vLLM may retain a few more), the rest of the chunk never;
    * ``local``: chunked local attention of ``tokens``-token attention chunks; every block
      (a chunk that ends inside an attention chunk needs its blocks back to that attention
      chunk's start, which earlier kvpool chunks hold only if they kept every block). A
      kvpool chunk must not straddle an attention chunk's edge: vLLM frees the blocks before
      the edge while the request runs, possibly before the kvpool chunk is full and stored.
    * ``state``: a state-space (Mamba) or linear-attention layer's running state, one block
      holding the state after a block's last token. Not part of a chunk: the state at a
      chunk's end is a record of its own (:func:`~kvpool.common.keys.state_key`), stored where
      vLLM hands one over (vLLM keeps states only where a step ended); per record, the one
      block.
    """

    kind: Literal["full", "window", "local", "state"]
    block_size: int
    tokens: int = 0

    @property
    def name(self) -> str:
        return self.kind if self.kind in ("full", "state") else f"{self.kind}{self.tokens}"

    @property
    def is_state(self) -> bool:
        return self.kind == "state"

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        """Blocks of a chunk (a state record: its one block, the state at the chunk's end)."""
        if chunk_tokens % self.block_size:
            raise LayoutError(
                f"chunk_tokens={chunk_tokens} is not a multiple of vLLM's block size "
                f"{self.block_size}"
            )
        return 1 if self.is_state else chunk_tokens // self.block_size

    def kept_blocks(self, chunk_tokens: int) -> int:
        """The chunk's last blocks this group stores (all, but for a window)."""
        per_chunk = self.blocks_per_chunk(chunk_tokens)
        if self.kind == "window":
            return min(per_chunk, -(-self.tokens // self.block_size))
        if self.kind == "local" and self.tokens % chunk_tokens:
            raise LayoutError(
                f"chunk_tokens={chunk_tokens} does not divide the model's {self.tokens}-token "
                "local attention chunks (vLLM frees a local chunk's blocks at its edge)"
            )
        return per_chunk


FULL_ATTENTION = "full"


@dataclass(frozen=True)
class GroupFormat:
    """One group's part of a chunk: ``layers x kept x page``, the chunk's last ``kept`` blocks."""

    rule: GroupRule
    layers: int
    blocks_per_chunk: int
    kept: int
    page_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def first_kept(self) -> int:
        """The first block of a chunk this group stores."""
        return self.blocks_per_chunk - self.kept

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * self.dtype.itemsize

    @property
    def section_bytes(self) -> int:
        return self.layers * self.kept * self.page_bytes

    def describe(self) -> str:
        page = "x".join(str(size) for size in self.page_shape)
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"layers={self.layers};blocks={self.blocks_per_chunk};page={page};dtype={dtype}"
            if self.kept == self.blocks_per_chunk and self.rule.kind == FULL_ATTENTION
            else f"{self.rule.name};layers={self.layers};blocks={self.blocks_per_chunk};"
            f"kept={self.kept};page={page};dtype={dtype}"
        )


@dataclass(frozen=True)
class ChunkFormat:
    """The byte layout of one chunk for this worker (see the module docstring)."""

    groups: tuple[GroupFormat, ...]
    content: str
    """What a page's bytes mean: the attention backends that write them."""

    @classmethod
    def of(
        cls,
        groups: Sequence[tuple[GroupRule, Sequence[BlockLayout]]],
        chunk_tokens: int,
        content: str,
    ) -> ChunkFormat:
        """The format for these groups (vLLM's order), each with its layers' layouts; the
        layers of a group must have the same page."""
        formats = []
        for rule, layouts in groups:
            if not layouts:
                raise LayoutError(f"a {rule.name} group without layers")
            first = layouts[0]
            for layout in layouts[1:]:
                if (layout.page_shape, layout.dtype) != (first.page_shape, first.dtype):
                    raise LayoutError(
                        f"layers differ: page {layout.page_shape} {layout.dtype} vs "
                        f"{first.page_shape} {first.dtype}"
                    )
            formats.append(
                GroupFormat(
                    rule,
                    len(layouts),
                    rule.blocks_per_chunk(chunk_tokens),
                    rule.kept_blocks(chunk_tokens),
                    first.page_shape,
                    first.dtype,
                )
            )
        if not formats:
            raise LayoutError("no attention layers to cache")
        return cls(tuple(formats), content)

    @property
    def chunk_bytes(self) -> int:
        return sum(group.section_bytes for group in self.groups)

    @property
    def layers(self) -> int:
        return sum(group.layers for group in self.groups)

    @property
    def frees_blocks(self) -> bool:
        """Some group lets vLLM free blocks before the request ends (a window, a state): a
        store must have copied them before the next step."""
        return any(group.rule.kind != FULL_ATTENTION for group in self.groups)

    def descriptor(self, states: ChunkFormat | None = None) -> str:
        """The ``kv_layout`` of the key fingerprint: everything that shapes a chunk's bytes,
        the groups' structure included, and the format of the ``states`` records beside the
        chunks, if any. One full-attention group keeps the first format's descriptor (its
        keys are those kvpool has always made)."""
        if len(self.groups) == 1 and self.groups[0].rule.kind == FULL_ATTENTION:
            chunk = f"{FORMAT_VERSION};layer-major;{self.groups[0].describe()}"
        else:
            groups = "|".join(group.describe() for group in self.groups)
            chunk = f"{GROUPS_FORMAT_VERSION};group-major;{groups}"
        if states is not None:
            chunk += ";states=" + "|".join(group.describe() for group in states.groups)
        return f"{chunk};content={self.content}"

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """A chunk's bytes (a uint8 tensor of ``chunk_bytes``) as one ``[L, kept, *page]``
        view per group."""
        views, offset = [], 0
        for group in self.groups:
            section = buffer[offset : offset + group.section_bytes]
            views.append(
                section.view(group.dtype).view(group.layers, group.kept, *group.page_shape)
            )
            offset += group.section_bytes
        return views
