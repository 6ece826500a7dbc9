"""``kvpool bench gpu``: the connector's copies between vLLM's KV cache on a GPU and the
agent's chunk files, against a raw copy measured in the same run.

A real ``kvpool-agent`` makes the chunk files (it never touches CUDA: the report says whether
its process maps a CUDA library); this process maps them from the agent's door as a vLLM
worker does (:class:`~kvpool.connector.copier.MappedChunks`: pageable memory, as a
sparse chunk file is never registered with CUDA whole), reserves chunks
through the agent's protocol (``prepare_store``, ``commit_store``, ``lookup`` with a lease) and
copies with the worker's :class:`~kvpool.connector.copier.BlockCopier`. Per KV cache
layout (:mod:`kvpool.tools.bench.gpu_caches`, random contents, scattered block ids) and chunk
size, each of ``--runs`` runs times, for a batch of chunks:

* ``kvpool``: the copier's store (GPU blocks -> chunk file) and load (chunk file -> other
  blocks);
  the loaded blocks must equal the stored ones byte for byte, or the bench fails;
* ``raw``: one ``cudaMemcpyAsync`` per chunk between a contiguous GPU buffer of the chunk's
  size and the chunk's (pageable) pages: the limit of what the same memory allows;
* ``unfused``: kvpool's copier with a launch per layer in each slab, as before its fused
  kernel (:mod:`kvpool.connector.fused`) and wherever that cannot run (no Triton); the
  ``kvpool fused`` column says whether kvpool's own copies of the layout were fused. On CPU
  caches both are the same numpy copies;
* ``per-block``: a naive loop, one copy per block and layer;
* ``staged``: every layer gathered into a contiguous GPU staging buffer, then one copy (and
  the reverse for a load): the batched alternative, at the cost of a chunk of GPU memory.

GB/s are medians over the runs with their min-max; the ratio is kvpool's to raw's, per run.
Then, on the Llama-3-8B layout: two processes that map the same chunk file and copy at once
(:mod:`kvpool.tools.bench.gpu_shared`), and the overlap of copies with compute
(:mod:`kvpool.tools.bench.gpu_overlap`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpool.client import AgentClient
from kvpool.common import keys, problems
from kvpool.common.sizes import parse_size
from kvpool.connector import fused
from kvpool.connector.copier import BlockCopier, MappedChunks
from kvpool.connector.layout import ChunkFormat
from kvpool.connector.staged import StagedCopies
from kvpool.tools.bench import gpu_overlap, gpu_shared
from kvpool.tools.bench.gpu_caches import (
    BLOCK_TOKENS,
    MODELS,
    Caches,
    ChunkCopies,
    Rig,
    batch_size,
    chunk_bytes,
    kept_ids,
    reserve,
    timed,
)
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN, running_agent
from kvpool.tools.bench.report import machine, median_spread, table

TENANT = keys.tenant_id("gpu-bench")
BATCH_BYTES = 512 << 20
"""Bytes copied per timed batch (at least one chunk, at most 16)."""
GOAL = 0.8
"""Store and load at >= 0.8 x the raw copy of the same memory, for 2048-token chunks."""
METHODS = ("kvpool", "raw", "unfused", "per-block", "per-layer", "staged")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        type=lambda text: _choices(text, MODELS),
        default=list(MODELS),
        help=f"KV cache layouts, comma-separated (default: {','.join(MODELS)})",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=_chunk_sizes,
        default=[256, 2048],
        help="chunk sizes in tokens, comma-separated (default: 256,2048)",
    )
    parser.add_argument("--runs", type=problems.number(int), default=5, help="timed runs")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="where the KV caches live (cpu: the same copies, for checking the bench itself)",
    )
    parser.add_argument(
        "--segment-dir",
        type=Path,
        default=Path("/dev/shm"),
        help="directory of the agent's segment (default: /dev/shm)",
    )
    parser.add_argument(
        "--l1-size", type=_size, default="6Gi", help="the agent's segment size (default: 6Gi)"
    )


def _chunk_sizes(text: str) -> list[int]:
    sizes = [int(size) for size in problems.numbers(int)(text)]
    for size in sizes:
        if size % BLOCK_TOKENS:
            raise argparse.ArgumentTypeError(
                f"expected multiples of vLLM's {BLOCK_TOKENS}-token blocks, not {size}"
            )
    return sizes


def _size(text: str) -> str:
    try:
        parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _choices(text: str, known: Collection[str]) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(known)}"
        )
    return names


@dataclass
class Rates:
    """Per method and direction, GB/s of each run."""

    store: dict[str, list[float]]
    load: dict[str, list[float]]


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "kvpool bench gpu needs a CUDA device (torch.cuda.is_available() is False); "
            "--device cpu runs the same copies on CPU caches"
        )
    settings = {
        "POOL": "gpu-bench",
        "L1_SIZE": args.l1_size,
        "LEASE_SECONDS": "600",
        "SEGMENT_PATH": str(args.segment_dir / f"kvpool-gpu-bench-{os.getpid()}"),
    }
    with (
        running_agent(settings, timeout=300) as agent,
        AgentClient(agent.zmq, token=ADMIN_TOKEN, timeout=120) as client,
    ):
        info = client.connect()
        started = time.perf_counter()
        files = MappedChunks(client.files(), info.segment_identity)
        mapped = time.perf_counter() - started
        rig = Rig(client, files, device)
        try:
            print(_header(device, files, mapped))
            rows = []
            for name in args.models:
                for tokens in args.chunk_tokens:
                    measured = _measure(rig, name, tokens, args.runs)
                    rows.append(_row(name, tokens, measured))
                    print("measured:", "  ".join(str(cell) for cell in rows[-1]), file=sys.stderr)
            print()
            print(table("copies between GPU blocks and the agent's chunk files", _HEADER, rows))
            print()
            shared = (args.models[0], max(args.chunk_tokens))
            print(gpu_shared.report(rig, shared, args.runs))
            if device.type == "cuda":
                print()
                print(gpu_overlap.report(rig, shared, args.runs))
            print()
            print(_agent_cuda(agent.pid))
        finally:
            files.close()
    print(machine())


_HEADER = (
    "layout",
    "chunk",
    "chunk MiB",
    "store GB/s",
    "load GB/s",
    "raw store",
    "raw load",
    "store/raw",
    "load/raw",
    "kvpool fused",
    "unfused st/ld",
    "per-block st/ld",
    "per-layer st/ld",
    "staged st/ld",
)


def _row(name: str, tokens: int, measured: tuple[int, Rates, list[bool]]) -> list[object]:
    size, rates, fused_groups = measured
    store, load = rates.store, rates.load

    def ratio(mine: list[float], raw: list[float]) -> str:
        return median_spread([a / b for a, b in zip(mine, raw, strict=True)], "{:.2f}")

    return [
        name,
        tokens,
        f"{size / 2**20:.1f}",
        median_spread(store["kvpool"], "{:.1f}"),
        median_spread(load["kvpool"], "{:.1f}"),
        median_spread(store["raw"], "{:.1f}"),
        median_spread(load["raw"], "{:.1f}"),
        ratio(store["kvpool"], store["raw"]),
        ratio(load["kvpool"], load["raw"]),
        _fused_cell(fused_groups),
        *(
            f"{statistics.median(store[method]):.1f}/{statistics.median(load[method]):.1f}"
            for method in METHODS[2:]
        ),
    ]


def _fused_cell(groups: list[bool]) -> str:
    """Whether kvpool's copies of a layout moved each slab in one launch."""
    if not groups:
        return "cpu"
    return "yes" if all(groups) else "no" if not any(groups) else f"{sum(groups)}/{len(groups)}"


def _header(device: torch.device, files: MappedChunks, mapped: float) -> str:
    if device.type != "cuda":
        return f"device: CPU caches; chunk files from the door {files.files.door}"
    why_not = fused.unavailable()
    props = torch.cuda.get_device_properties(device)
    link = _nvidia_smi("pcie.link.gen.current,pcie.link.width.current,driver_version")
    return (
        f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
        f" (PCIe gen,width,driver: {link}); chunk files from the door {files.files.door}, "
        f"not pinned (sparse) (connect: {mapped:.1f} s); fused copies: "
        f"{why_not or 'one Triton launch a slab'}"
    )


def _nvidia_smi(fields: str) -> str:
    try:
        answer = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return answer.stdout.strip()


def _agent_cuda(pid: int) -> str:
    maps = Path(f"/proc/{pid}/maps").read_text()
    cuda = sorted({line.split()[-1] for line in maps.splitlines() if "libcuda" in line})
    return (
        f"agent pid {pid}: maps {', '.join(cuda)} (a CUDA context!)"
        if cuda
        else f"agent pid {pid}: maps no CUDA library (no CUDA context)"
    )


# ------------------------------------------------------------------ one layout, one chunk size


def _measure(rig: Rig, name: str, tokens: int, runs: int) -> tuple[int, Rates, list[bool]]:
    size = chunk_bytes(name, tokens)
    count = batch_size(size, BATCH_BYTES, 16)
    copies = ChunkCopies.make(name, tokens, count, rig.device, seed=1)
    methods = _Methods(copies.caches, copies.format, rig.device)
    rates = Rates({method: [] for method in METHODS}, {method: [] for method in METHODS})
    for run in range(runs + 1):  # run 0 warms up: the first copies through new mappings are slow
        _run_once(rig, copies, methods, rates if run else None)
    return size, rates, copies.copier.fused


def _run_once(rig: Rig, copies: ChunkCopies, methods: _Methods, rates: Rates | None) -> None:
    """Store a batch of chunks through the agent, load them back, then the other methods."""
    size, count = copies.format.chunk_bytes, len(copies.sources)
    client, device = rig.client, rig.device

    def record(direction: dict[str, list[float]], method: str, seconds: float) -> None:
        if rates is not None:
            direction[method].append(count * size / seconds / 1e9)

    keys, plan = reserve(client, TENANT, count, size)
    assert plan.lease is not None
    stored = [rig.files.chunk(plan.file, offset, size, write=True) for offset in plan.offsets]
    store_rates = rates.store if rates else {}
    load_rates = rates.load if rates else {}
    record(store_rates, "kvpool", timed(device, functools.partial(copies.store, stored)))
    client.commit_store(plan.lease)
    hit = client.lookup(TENANT, keys, lock=True)
    if hit.count != count or hit.lease is None:
        raise SystemExit(f"the agent found {hit.count} of the {count} chunks just stored")
    chunks = [rig.files.chunk(hit.file, offset, size) for offset in hit.offsets]
    copies.clear_targets()
    record(load_rates, "kvpool", timed(device, functools.partial(copies.load, chunks)))
    copies.check("kvpool's copier")
    for method in METHODS[1:]:
        store, load = methods.get(method, chunks, copies.sources, copies.targets)
        record(store_rates, method, timed(device, store))
        record(load_rates, method, timed(device, load))
    client.release(hit.lease)
    client.clear(TENANT)


class _Methods:
    """The baselines and the alternatives, each issuing on its own side stream."""

    def __init__(self, caches: Caches, chunk_format: ChunkFormat, device: torch.device) -> None:
        self._views = caches.block_views
        self._format = chunk_format
        self._device = device
        size = chunk_format.chunk_bytes
        self._contiguous = torch.empty(size, dtype=torch.uint8, device=device)
        self._staging = torch.empty(size, dtype=torch.uint8, device=device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._unfused = (
            StagedCopies(self._views, chunk_format, fused=False)
            if device.type == "cuda"
            else BlockCopier(self._views, chunk_format)
        )
        """kvpool's copier with a launch per layer (on CPU, its only copies)."""

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def get(
        self,
        method: str,
        chunks: Sequence[torch.Tensor],
        sources: Sequence[Sequence[int]],
        targets: Sequence[Sequence[int]],
    ) -> tuple[Callable[[], None], Callable[[], None]]:
        if method == "raw":
            return (lambda: self._raw(chunks, store=True)), (lambda: self._raw(chunks, store=False))
        if method == "unfused":
            return (lambda: self._slabs_per_layer(chunks, sources, store=True)), (
                lambda: self._slabs_per_layer(chunks, targets, store=False)
            )
        if method == "per-block":
            return (lambda: self._per_block(chunks, sources, store=True)), (
                lambda: self._per_block(chunks, targets, store=False)
            )
        if method == "per-layer":
            return (lambda: self._per_layer(chunks, sources, store=True)), (
                lambda: self._per_layer(chunks, targets, store=False)
            )
        return (lambda: self._staged(chunks, sources, store=True)), (
            lambda: self._staged(chunks, targets, store=False)
        )

    def _raw(self, chunks: Sequence[torch.Tensor], *, store: bool) -> None:
        with self._on_stream():
            for chunk in chunks:
                if store:
                    chunk.copy_(self._contiguous, non_blocking=True)
                else:
                    self._contiguous.copy_(chunk, non_blocking=True)

    def _groups(
        self, chunks: Sequence[torch.Tensor], blocks: Sequence[Sequence[int]]
    ) -> Iterator[tuple[torch.Tensor, list[torch.Tensor], list[int]]]:
        """Per chunk and group: the chunk's ``[L, kept, *page]`` view, the group's layers and
        the ids of the blocks it keeps."""
        for chunk, ids in zip(chunks, blocks, strict=True):
            yield from zip(
                self._format.views(chunk),
                self._views,
                kept_ids(self._format, list(ids)),
                strict=True,
            )

    def _slabs_per_layer(
        self, chunks: Sequence[torch.Tensor], blocks: Sequence[Sequence[int]], *, store: bool
    ) -> None:
        """kvpool's copier as before the fused kernel (and where it is not): its slabs, each
        layer gathered or scattered by a launch of its own."""
        for chunk, ids in zip(chunks, blocks, strict=True):
            kept = kept_ids(self._format, list(ids))
            if store:
                self._unfused.store(chunk, kept)
            else:
                self._unfused.load(chunk, [(0, group) for group in kept])

    def _per_block(
        self, chunks: Sequence[torch.Tensor], blocks: Sequence[Sequence[int]], *, store: bool
    ) -> None:
        with self._on_stream():
            for pages, views, kept in self._groups(chunks, blocks):
                for layer, view in enumerate(views):
                    for index, block in enumerate(kept):
                        if store:
                            pages[layer, index].copy_(view[block], non_blocking=True)
                        else:
                            view[block].copy_(pages[layer, index], non_blocking=True)

    def _per_layer(
        self, chunks: Sequence[torch.Tensor], blocks: Sequence[Sequence[int]], *, store: bool
    ) -> None:
        """kvpool's copier before staging: per layer, one gather and one copy to the host."""
        with self._on_stream():
            for pages, views, kept in self._groups(chunks, blocks):
                index = torch.tensor(kept, dtype=torch.long).to(self._device, non_blocking=True)
                for layer, view in enumerate(views):
                    if store:
                        pages[layer].copy_(view.index_select(0, index), non_blocking=True)
                    else:
                        view.index_copy_(0, index, pages[layer].to(self._device, non_blocking=True))

    def _staged(
        self, chunks: Sequence[torch.Tensor], blocks: Sequence[Sequence[int]], *, store: bool
    ) -> None:
        staged = self._format.views(self._staging)
        with self._on_stream():
            for chunk, ids in zip(chunks, blocks, strict=True):
                if not store:
                    self._staging.copy_(chunk, non_blocking=True)
                for pages, views, kept in zip(
                    staged, self._views, kept_ids(self._format, list(ids)), strict=True
                ):
                    index = torch.tensor(kept, dtype=torch.long).to(self._device, non_blocking=True)
                    for layer, view in enumerate(views):
                        if store:
                            torch.index_select(view, 0, index, out=pages[layer])
                        else:
                            view.index_copy_(0, index, pages[layer])
                if store:
                    chunk.copy_(self._staging, non_blocking=True)
