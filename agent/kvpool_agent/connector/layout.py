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
layer of this worker)::

    chunk = layer 0 | layer 1 | ... | layer L-1             (vLLM's layer order)
    layer = page(block 0) | page(block 1) | ... | page(block nb-1)   (token order)
    page  = one block's data, C-contiguous in the logical page shape, e.g. [H, N, C]

No padding and no header: ``chunk_bytes = L * nb * prod(page_shape) * itemsize``.
The bytes do not depend on the physical order of the tensor (an NHD engine and
an HND engine of the same model write identical chunks). What a page's bytes
*mean* is the attention backend's business (the CPU backend stores K rows then
V rows per head, for instance), so :meth:`ChunkFormat.descriptor` names the
backend as the content kind; the descriptor is part of every key's fingerprint,
so engines whose pages differ never share a key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STANDARD_DIM_NAMES = "BHNC"
"""vLLM's standardized per-layer view: blocks, heads, tokens in block, content."""
FORMAT_VERSION = "kvpool-chunk-v1"


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


@dataclass(frozen=True)
class ChunkFormat:
    """The byte layout of one chunk for this worker (see the module docstring)."""

    layers: int
    blocks_per_chunk: int
    page_shape: tuple[int, ...]
    dtype: torch.dtype
    content: str
    """What a page's bytes mean: the attention backend that writes them."""

    @classmethod
    def of(
        cls, layouts: list[BlockLayout], chunk_tokens: int, block_size: int, content: str
    ) -> ChunkFormat:
        """The format for these layers; every layer must have the same page."""
        if not layouts:
            raise LayoutError("no attention layers to cache")
        first = layouts[0]
        for layout in layouts[1:]:
            if (layout.page_shape, layout.dtype) != (first.page_shape, first.dtype):
                raise LayoutError(
                    f"layers differ: page {layout.page_shape} {layout.dtype} vs "
                    f"{first.page_shape} {first.dtype}"
                )
        if chunk_tokens % block_size:
            raise LayoutError(
                f"chunk_tokens={chunk_tokens} is not a multiple of vLLM's block size {block_size}"
            )
        return cls(len(layouts), chunk_tokens // block_size, first.page_shape, first.dtype, content)

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * self.dtype.itemsize

    @property
    def layer_bytes(self) -> int:
        return self.blocks_per_chunk * self.page_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.layers * self.layer_bytes

    def descriptor(self) -> str:
        """The ``kv_layout`` of the key fingerprint: everything that shapes a chunk's bytes."""
        page = "x".join(str(size) for size in self.page_shape)
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{FORMAT_VERSION};layer-major;layers={self.layers};blocks={self.blocks_per_chunk};"
            f"page={page};dtype={dtype};content={self.content}"
        )

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """A chunk's bytes (a uint8 tensor of ``chunk_bytes``) as ``[L, nb, *page]``."""
        return buffer.view(self.dtype).view(self.layers, self.blocks_per_chunk, *self.page_shape)
