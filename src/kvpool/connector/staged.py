"""Chunk copies between a GPU's KV blocks and host memory, through staging slabs.

A chunk's bytes are layer after layer (:mod:`kvpool.connector.layout`); vLLM's blocks
are scattered over each layer's cache. Copying each layer's blocks straight to the host costs
one DMA per layer, each waiting for its gather, and the copy engine idles in between (measured
on an H200, Llama-3-8B layout: 0.83 x the raw PCIe copy for 2048-token chunks, 0.41 for
256-token ones). Here a chunk moves as *slabs*: runs of whole layers of at most ``SLAB_BYTES``
(at least one layer). On the *gather* stream each layer's blocks are gathered into a slab
buffer on the GPU (one ``index_select`` per layer, at device-memory speed); on the *DMA*
stream the slab goes to the host in one copy, while the next slab is being gathered into the
other buffer. A load runs the other way (DMA into a slab, then one ``index_copy_`` per layer).
Two buffers of ``SLAB_BYTES`` (or one layer, if larger) are the GPU memory this costs.
Where Triton is installed and its kernel compiles, a slab's gather (and scatter) is one
launch for all its layers (:mod:`kvpool.connector.fused`): a launch per layer bounds the copy
of small pages; a group the fused kernel cannot take is copied layer by layer, as everywhere
without Triton.

Events order the two streams: a gather waits until the DMA that last read its buffer has
finished, a DMA waits for its gather (and a load's scatter for its DMA, the next DMA into the
buffer for that scatter). Only the caller's streams are synchronised with the outside:
a store's gathers start after the compute stream's work so far (the blocks are computed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.connector.fused import FusedPages
from kvpool.connector.layout import ChunkFormat

SLAB_BYTES = 32 << 20


@dataclass(frozen=True)
class Slab:
    """A run of whole layers of one group: bytes ``offset`` to ``offset + size`` of a chunk."""

    group: int
    layers: range
    offset: int
    size: int


def slabs(chunk_format: ChunkFormat, limit: int = SLAB_BYTES) -> list[Slab]:
    """The chunk's layers in runs of at most ``limit`` bytes (a larger layer runs alone)."""
    result: list[Slab] = []
    offset = 0
    for index, group in enumerate(chunk_format.groups):
        layer_bytes = group.kept * group.page_bytes
        per_slab = max(1, limit // layer_bytes) if layer_bytes else group.layers
        for first in range(0, group.layers, per_slab):
            layers = range(first, min(first + per_slab, group.layers))
            result.append(Slab(index, layers, offset, len(layers) * layer_bytes))
            offset += len(layers) * layer_bytes
    return result


def block_index(ids: Sequence[int], num_blocks: int, device: torch.device) -> torch.Tensor:
    """``ids`` as an index on ``device`` (copied beside the caller's stream); ValueError for an
    id that is no block of the cache: the fused kernel writes where an id points, unchecked,
    and a launch per layer would fail on the device, taking the CUDA context with it."""
    wrong = [block for block in ids if not 0 <= block < num_blocks]
    if wrong:
        raise ValueError(f"block ids {wrong[:4]} outside the cache's {num_blocks} blocks")
    return torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)


class StagedCopies:
    """Pipelined store and load of chunks for one set of caches on one CUDA device."""

    def __init__(
        self,
        caches: Sequence[Sequence[torch.Tensor]],
        chunk_format: ChunkFormat,
        slab_bytes: int = SLAB_BYTES,
        *,
        fused: bool = True,
    ) -> None:
        """``fused``: a slab's layers in one launch where they can be (else one per layer)."""
        self._caches = caches
        self._fused = [FusedPages.of(group) if fused else None for group in caches]
        self._format = chunk_format
        self._slabs = slabs(chunk_format, slab_bytes)
        self.device = caches[0][0].device
        self.dma = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.gather = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        """Where a store's gathers and a load's scatters run."""
        size = max(slab.size for slab in self._slabs)
        self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._free = [torch.cuda.Event() for _ in range(2)]  # type: ignore[no-untyped-call]
        """Recorded when the last user of each buffer is done with it."""
        self._turn = 0

    def _pages(self, buffer: torch.Tensor, slab: Slab) -> list[torch.Tensor]:
        """The slab's layers in ``buffer``, each ``[kept, *page]``."""
        group = self._format.groups[slab.group]
        layer_bytes = group.kept * group.page_bytes
        return [
            buffer[i * layer_bytes : (i + 1) * layer_bytes]
            .view(group.dtype)
            .view(group.kept, *group.page_shape)
            for i in range(len(slab.layers))
        ]

    @property
    def fused(self) -> list[bool]:
        """Whether each group's slabs are copied in one launch (else one per layer)."""
        return [pages is not None for pages in self._fused]

    def _next_buffer(self) -> tuple[torch.Tensor, torch.cuda.Event]:
        turn = self._turn
        self._turn ^= 1
        return self._buffers[turn], self._free[turn]

    def store(self, chunk: torch.Tensor, block_ids: Sequence[Sequence[int]]) -> torch.cuda.Event:
        """Gather the kept blocks (``block_ids[g]``) and copy them into ``chunk`` (host memory); the
        event is recorded when the bytes are there."""
        self.gather.wait_stream(torch.cuda.current_stream(self.device))  # blocks computed
        with torch.cuda.stream(self.gather):
            indexes = [
                block_index(ids, group[0].shape[0], self.device)
                for ids, group in zip(block_ids, self._caches, strict=True)
            ]
        for slab in self._slabs:
            buffer, free = self._next_buffer()
            self.gather.wait_event(free)
            with torch.cuda.stream(self.gather):
                self._gather(slab, indexes[slab.group], buffer)
            gathered = torch.cuda.Event()  # type: ignore[no-untyped-call]
            gathered.record(self.gather)
            self.dma.wait_event(gathered)
            with torch.cuda.stream(self.dma):
                chunk[slab.offset : slab.offset + slab.size].copy_(
                    buffer[: slab.size], non_blocking=True
                )
            free.record(self.dma)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self.dma)
        return done

    def load(
        self, chunk: torch.Tensor, targets: Sequence[tuple[int, Sequence[int]]]
    ) -> torch.cuda.Event:
        """Copy ``chunk`` (host memory) into the blocks: per group ``(first, block_ids)``, the
        group's kept blocks from ``first`` on go to ``block_ids``; the event is recorded when
        every block holds its bytes."""
        self.gather.wait_stream(torch.cuda.current_stream(self.device))  # blocks are free
        with torch.cuda.stream(self.gather):
            indexes = [
                block_index(ids, group[0].shape[0], self.device) if ids else None
                for (_, ids), group in zip(targets, self._caches, strict=True)
            ]
        for slab in self._slabs:
            first, _ = targets[slab.group]
            index = indexes[slab.group]
            if index is None:
                continue  # vLLM wants none of this group's blocks
            buffer, free = self._next_buffer()
            self.dma.wait_event(free)
            with torch.cuda.stream(self.dma):
                buffer[: slab.size].copy_(
                    chunk[slab.offset : slab.offset + slab.size], non_blocking=True
                )
            arrived = torch.cuda.Event()  # type: ignore[no-untyped-call]
            arrived.record(self.dma)
            self.gather.wait_event(arrived)
            with torch.cuda.stream(self.gather):
                self._scatter(slab, index, first, buffer)
            free.record(self.gather)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self.gather)
        return done

    def _gather(self, slab: Slab, index: torch.Tensor, buffer: torch.Tensor) -> None:
        """The slab's blocks ``index`` of each layer into ``buffer``, on the current stream."""
        fused = self._fused[slab.group]
        if fused is not None:
            fused.gather(slab.layers, index, buffer[: slab.size])
            return
        for layer, pages in zip(slab.layers, self._pages(buffer, slab), strict=True):
            torch.index_select(self._caches[slab.group][layer], 0, index, out=pages)

    def _scatter(self, slab: Slab, index: torch.Tensor, first: int, buffer: torch.Tensor) -> None:
        """Each layer's pages ``first`` on in ``buffer`` into its blocks ``index``, on the
        current stream."""
        fused = self._fused[slab.group]
        if fused is not None:
            kept = self._format.groups[slab.group].kept
            fused.scatter(slab.layers, index, first, kept, buffer[: slab.size])
            return
        for layer, pages in zip(slab.layers, self._pages(buffer, slab), strict=True):
            self._caches[slab.group][layer].index_copy_(0, index, pages[first : first + len(index)])

    def synchronize(self) -> None:
        self.dma.synchronize()
        self.gather.synchronize()
