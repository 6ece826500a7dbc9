"""A slab's blocks of every layer in one kernel launch: the gather of a store and the scatter of
a load (:mod:`kvpool.connector.staged`), written in Triton.

Copying a chunk layer by layer (one ``index_select`` or ``index_copy_`` per layer) costs a
kernel launch per layer, and for a chunk of small pages the launches are the copy's time
(``docs/vllm/gpus.md``: 0.15 of a raw copy for a model with 2 KV heads at 256 tokens). Here one
launch moves a slab: every layer of it, every block the chunk keeps, every page.

Each layer is the ``[num_blocks, *page]`` view the copier holds
(:meth:`~kvpool.connector.layout.BlockLayout.blocks`). A page is cut into *runs*: its dimensions
merged where memory allows, the innermost a contiguous run of elements, at most
:data:`OUTER_DIMS` dimensions around it with their strides (FlashAttention's ``[2, B, 16, H,
D]``: two runs a block, K's and V's; MLA's latent: one; an ``HND`` cache with the page
``[2, N, H, D]``: a run per token and head). Each program moves a piece of one run of one
block of one layer, in machine words as wide as the runs, strides and addresses allow (the
copy is of bits: no value is converted). The staging buffer holds the slab as the chunk
does: layer after layer, each ``[kept, *page]`` with the page C-contiguous in its logical
order (:mod:`kvpool.connector.layout`), so the bytes are those of the per-layer path.

The layers of a slab share one view shape, strides and dtype (one group's caches, as vLLM
allocates them). A group whose layers differ (in shape, strides, dtype or the words their
addresses allow), or whose page has more than :data:`OUTER_DIMS` dimensions around its
runs, is copied layer by layer; so is every group where Triton is not installed
(:func:`unavailable`) or the kernel does not compile (said in the log). The kernel is
compiled when the copies are made (vLLM's start), not at a forward's first copy: its
integers and pointers are not specialized on their values, so one compiled kernel a way
serves every copy of a group.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

OUTER_DIMS = 3
"""The page's dimensions around its contiguous runs that one launch walks."""
PIECE_WORDS = 1024
"""The most words one program moves (a run longer than this is split over programs)."""
WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
"""The word each copy moves, by its bytes."""


@functools.cache
def unavailable() -> str | None:
    """None where the fused copies can run here; else why not, in one line."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"Triton is not installed ({error}): slabs are copied layer by layer"
    return None


@dataclass(frozen=True)
class Runs:
    """One layer's page as runs, in words: ``outer`` (size, stride) pairs around a run of
    ``run`` contiguous words, a block ``block_stride`` words from the next."""

    word: torch.dtype
    block_stride: int
    outer: tuple[tuple[int, int], ...]
    """:data:`OUTER_DIMS` (size, stride) pairs, outermost first (size 1 where unused)."""
    run: int

    @property
    def runs_per_page(self) -> int:
        return math.prod(size for size, _ in self.outer)


def runs_of(view: torch.Tensor) -> Runs | None:
    """``view`` (``[num_blocks, *page]``) as runs, or None where a page has more than
    :data:`OUTER_DIMS` dimensions around its runs."""
    dims = _merged(
        [(size, stride) for size, stride in zip(view.shape[1:], view.stride()[1:], strict=True)]
    )
    run = 1
    if dims and dims[-1][1] == 1:
        run = dims.pop()[0]
    if len(dims) > OUTER_DIMS:
        return None
    itemsize = view.element_size()
    strides = [view.stride(0)] + [stride for _, stride in dims]
    in_bytes = [view.data_ptr(), run * itemsize] + [stride * itemsize for stride in strides]
    word_bytes = max(size for size in WORDS if all(value % size == 0 for value in in_bytes))
    scale = word_bytes // itemsize
    if not scale:  # an address not aligned to its own elements
        return None
    outer = [(size, stride // scale) for size, stride in dims]
    return Runs(WORDS[word_bytes], view.stride(0) // scale, _padded(outer), run // scale)


def _merged(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The dimensions with those of size 1 dropped and each merged into the one before it
    where the two are one range of memory."""
    merged: list[tuple[int, int]] = []
    for size, stride in dims:
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    return merged


def _padded(outer: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    return tuple([(1, 0)] * (OUTER_DIMS - len(outer)) + list(outer))


class FusedPages:
    """One group's layers (``[num_blocks, *page]`` views of one shape, strides and dtype),
    gathered into and scattered from a staging buffer a slab of layers at a time, one launch
    each."""

    def __init__(self, views: Sequence[torch.Tensor], runs: Runs) -> None:
        self._runs = runs
        self._views = list(views)
        """Held so that the memory the addresses name stays the caches'."""
        self._bases = torch.tensor(
            [view.data_ptr() for view in views], dtype=torch.int64, device=views[0].device
        )
        """Each layer's first block's address, on the device."""
        self._piece = min(PIECE_WORDS, 1 << (runs.run - 1).bit_length())

    @classmethod
    def of(cls, views: Sequence[torch.Tensor]) -> FusedPages | None:
        """The fused copies of ``views``, or None where they cannot be (see the module). On a
        GPU the kernel is compiled here, both ways, not at a forward's first copy; a kernel
        that does not compile leaves the group to the per-layer path, saying why."""
        if unavailable() is not None or not views:
            return None
        first = views[0]
        shape = (first.shape, first.stride(), first.dtype)
        if any((view.shape, view.stride(), view.dtype) != shape for view in views):
            return None
        per_layer = [runs_of(view) for view in views]
        runs = per_layer[0]
        if runs is None or any(other is None or other.word != runs.word for other in per_layer):
            return None
        pages = cls(views, runs)
        if first.device.type == "cuda":
            try:
                pages._compile()
            except Exception as error:  # Triton's errors name no common base
                log.warning("fused copies off for layers of %s: %s", tuple(first.shape), error)
                return None
        return pages

    def gather(self, layers: range, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Blocks ``ids`` of ``layers`` into ``out`` (bytes: each layer's ``[len(ids), *page]``,
        one after another), on the current stream."""
        self._launch(layers, ids, 0, len(ids), out, gather=True)

    def scatter(
        self, layers: range, ids: torch.Tensor, first: int, kept: int, source: torch.Tensor
    ) -> None:
        """Pages ``first`` to ``first + len(ids)`` of each layer's ``kept`` in ``source`` (bytes,
        laid out as :meth:`gather` writes them) into blocks ``ids``, on the current stream."""
        self._launch(layers, ids, first, kept, source, gather=False)

    def _launch(
        self,
        layers: range,
        ids: torch.Tensor,
        first: int,
        kept: int,
        buffer: torch.Tensor,
        *,
        gather: bool,
    ) -> None:
        count = len(layers) * len(ids) * self._runs.runs_per_page
        if count:
            grid = (count, -(-self._runs.run // self._piece))
            arguments = self._arguments(layers, ids, first, kept, buffer)
            _kernel()[grid](*arguments, **self._options(gather))

    def _compile(self) -> None:
        """Compile the kernel for this group's copies, both ways (nothing runs)."""
        ids = torch.zeros(1, dtype=torch.int64, device=self._bases.device)
        buffer = torch.empty(self._runs.run, dtype=self._runs.word, device=self._bases.device)
        arguments = self._arguments(range(1), ids, 0, 1, buffer.view(torch.uint8))
        for gather in (True, False):
            _kernel().warmup(*arguments, grid=(1, 1), **self._options(gather))

    def _arguments(
        self, layers: range, ids: torch.Tensor, first: int, kept: int, buffer: torch.Tensor
    ) -> tuple[object, ...]:
        runs = self._runs
        (_, s0), (n1, s1), (n2, s2) = runs.outer
        return (
            self._bases[layers.start : layers.stop],
            ids,
            buffer.view(runs.word),
            len(ids),
            first,
            kept,
            runs.block_stride,
            runs.runs_per_page,
            n1,
            n2,
            s0,
            s1,
            s2,
            runs.run,
        )

    def _options(self, gather: bool) -> dict[str, object]:
        """The kernel's constants, and its warps: a thread per word of a piece, at most 4."""
        return {
            "WORD": _triton_word(self._runs.word),
            "GATHER": gather,
            "PIECE": self._piece,
            "num_warps": max(1, min(4, self._piece // 32)),
        }


def _triton_word(word: torch.dtype) -> Any:
    """Triton's name for one of :data:`WORDS` (``torch.int64``: ``tl.int64``)."""
    import triton.language as tl

    return getattr(tl, str(word).removeprefix("torch."))


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, made on first use (so that Triton is imported only where it runs,
    and its interpreter, ``TRITON_INTERPRET=1``, can be chosen before: the tests' CPU run)."""
    import triton
    import triton.language as tl

    # every integer but the constexprs varies from copy to copy: one compiled kernel for all
    @triton.jit(  # type: ignore[untyped-decorator]
        do_not_specialize=[
            "blocks",
            "first",
            "kept",
            "block_stride",
            "runs_per_page",
            "n1",
            "n2",
            "s0",
            "s1",
            "s2",
            "run",
        ],
        do_not_specialize_on_alignment=["bases", "ids", "buffer"],
    )
    def copy_pages(  # type: ignore[no-untyped-def]  # noqa: PLR0917 (positional, a kernel's)
        bases,  # no annotations: Triton's compiler reads them as the arguments' types
        ids,
        buffer,
        blocks,
        first,
        kept,
        block_stride,
        runs_per_page,
        n1,
        n2,
        s0,
        s1,
        s2,
        run,
        WORD: tl.constexpr,
        GATHER: tl.constexpr,
        PIECE: tl.constexpr,
    ):
        """Program ``(r, p)``: piece ``p`` of run ``r``, the runs counted over the layers,
        each layer's ``blocks`` blocks, and each page's runs ``(i0, i1, i2)`` in C order."""
        index = tl.program_id(0).to(tl.int64)
        per_layer = blocks * runs_per_page
        layer = index // per_layer
        block = index % per_layer // runs_per_page
        outer = index % runs_per_page
        i2 = outer % n2
        i1 = outer // n2 % n1
        i0 = outer // n2 // n1
        base = tl.load(bases + layer).to(tl.pointer_type(WORD))
        block_id = tl.load(ids + block).to(tl.int64)
        cache_at = block_id * block_stride + i0 * s0 + i1 * s1 + i2 * s2
        buffer_at = ((layer * kept + first + block) * runs_per_page + outer) * run
        offsets = tl.program_id(1).to(tl.int64) * PIECE + tl.arange(0, PIECE)
        inside = offsets < run
        if GATHER:
            words = tl.load(base + cache_at + offsets, mask=inside)
            tl.store(buffer + buffer_at + offsets, words, mask=inside)
        else:
            words = tl.load(buffer + buffer_at + offsets, mask=inside)
            tl.store(base + cache_at + offsets, words, mask=inside)

    return copy_pages
