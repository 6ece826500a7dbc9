"""The copy primitive: whole blocks between vLLM's KV cache and chunks in mapped chunk files.

:class:`MappedChunks` maps the agent's chunk files into the worker, as the agent's door
gives them. :class:`BlockCopier` moves one chunk at a time:

* ``store``: the blocks each group keeps of the chunk, every layer -> the reserved bytes
  in the chunk file;
* ``load``: a chunk's bytes -> the blocks (per group, those vLLM allocated real blocks for).

On CPU both are numpy memcpys of whole pages and are finished when they
return. On CUDA they run on side streams through GPU staging slabs
(:mod:`kvpool.connector.staged`), from and to pageable host memory: a store waits for the
compute stream's work so far (the blocks are computed) and a load makes the compute stream
wait for it when this step's forward reads the blocks, so neither blocks the host. Each
returns a :class:`Copy` to poll: the agent's lease is committed or released only when the
copy has finished.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from kvpool.client.mapped_files import MappedChunkFiles
from kvpool.connector.layout import ChunkFormat, LayoutError
from kvpool.connector.staged import StagedCopies


class Copy(Protocol):
    def done(self) -> bool:
        """True once the bytes have arrived (never blocks)."""

    def wait(self) -> None:
        """Block until the bytes have arrived."""


class _Finished:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


FINISHED: Copy = _Finished()


class _CudaCopy:
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self._event.synchronize()


class MappedChunks:
    """The agent's chunk files mapped here (:mod:`kvpool.client.mapped_files`), each as one
    uint8 tensor.

    Never pinned: a chunk file is sparse (it holds memory only where its account's chunks
    are), and registering it whole would give it memory everywhere.
    """

    def __init__(self, files: MappedChunkFiles, identity: tuple[int, int]) -> None:
        self.files = files
        self.identity = identity
        """The agent's segment these files go with (see :class:`~kvpool.client.AgentInfo`)."""
        self._tensors: dict[int, torch.Tensor] = {}

    def chunk(self, file_id: int, offset: int, size: int, *, write: bool = False) -> torch.Tensor:
        """``size`` bytes at ``offset`` of the file ``file_id``: :class:`ChunkFileError` if
        they cannot be had (or written, with ``write``)."""
        mapped = self.files.check(file_id, offset, size, write=write)
        tensor = self._tensors.get(file_id)
        if tensor is None:
            with warnings.catch_warnings():  # a read-only file is only read
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(mapped.mapping, dtype=torch.uint8)
            self._tensors[file_id] = tensor
        return tensor[offset : offset + size]

    def close(self) -> None:
        self._tensors.clear()  # the mappings cannot close while a tensor exports them
        self.files.close()


Pages = np.ndarray[Any, np.dtype[np.uint8]]


def _as_bytes(tensor: torch.Tensor) -> Pages:
    """The bytes of a CPU tensor as a numpy view (its last dimension must be dense)."""
    if tensor.stride()[-1] != 1 and tensor.shape[-1] != 1:
        raise LayoutError(f"the innermost dimension of {tuple(tensor.shape)} is strided")
    return tensor.view(torch.uint8).numpy()


class BlockCopier:
    """Copies chunks between vLLM's caches and bytes: ``caches[g]`` holds group ``g``'s
    ``[num_blocks, *page]`` views, one per layer, in the chunk format's order.

    On CPU the copies are numpy's: single-threaded memcpys of whole pages. torch's
    ``index_select`` would split them over vLLM's OpenMP threads, and on a busy
    machine one descheduled thread holds every copy up at the barrier (measured:
    200 ms instead of 2 ms for 4 MiB at a load average of 10 on 2 cores).
    """

    def __init__(self, caches: Sequence[Sequence[torch.Tensor]], chunk_format: ChunkFormat) -> None:
        self._caches = [list(group) for group in caches]
        self._format = chunk_format
        self.device = self._caches[0][0].device
        self._staged: StagedCopies | None = None
        self._arrays: list[list[Pages]] = []
        if self.device.type == "cuda":
            self._staged = StagedCopies(self._caches, chunk_format)
        else:
            self._arrays = [[_as_bytes(cache) for cache in group] for group in self._caches]

    @property
    def fused(self) -> list[bool]:
        """Whether each group's CUDA copies move a slab in one launch
        (:mod:`kvpool.connector.fused`); none on CPU."""
        return [] if self._staged is None else self._staged.fused

    @property
    def synchronous(self) -> bool:
        """Copies have finished when ``store``/``load`` return."""
        return self._staged is None

    def store(self, chunk: torch.Tensor, block_ids: Sequence[Sequence[int]]) -> Copy:
        """Copy the blocks each group keeps (``block_ids[g]``, ``kept`` ids) into ``chunk``."""
        if self._staged is not None:
            return _CudaCopy(self._staged.store(chunk, block_ids))
        destinations = self._format.views(chunk)
        for group, arrays, destination in zip(block_ids, self._arrays, destinations, strict=True):
            pages = destination.view(torch.uint8).numpy()
            rows = np.asarray(group, dtype=np.intp)
            for layer, array in enumerate(arrays):
                np.take(array, rows, axis=0, out=pages[layer])
        return FINISHED

    def load(
        self,
        chunk: torch.Tensor,
        targets: Sequence[tuple[int, Sequence[int]]],
        *,
        forward_reads: bool = True,
    ) -> Copy:
        """Copy ``chunk`` into vLLM's blocks: per group ``(first, block_ids)``, the group's
        kept blocks from ``first`` on go to ``block_ids``.

        ``forward_reads``: this step's forward reads the blocks, so on CUDA the compute
        stream waits for the copy. A load for a request that is not in this step's batch
        (vLLM waits for its ``finished_recving``) passes False: the forward then runs
        beside the copy, and whoever reports the request waits for the :class:`Copy`."""
        if self._staged is not None:
            done = self._staged.load(chunk, targets)
            if forward_reads:
                torch.cuda.current_stream(self.device).wait_event(done)
            return _CudaCopy(done)
        sources = [
            view[:, first : first + len(ids)]
            for view, (first, ids) in zip(self._format.views(chunk), targets, strict=True)
        ]
        for (_, ids), arrays, source in zip(targets, self._arrays, sources, strict=True):
            if not ids:
                continue
            pages = source.view(torch.uint8).numpy()
            rows = np.asarray(ids, dtype=np.intp)
            for layer, array in enumerate(arrays):
                array[rows] = pages[layer]
        return FINISHED

    def flush(self) -> None:
        """Wait for every copy issued so far."""
        if self._staged is not None:
            self._staged.synchronize()
