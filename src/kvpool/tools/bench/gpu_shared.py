"""Two processes map the agent's chunk file and copy into it at once (two vLLM pods on one node):
each maps it from the agent's door and stores and loads its own chunks, reserved through
the agent. Reported: each process's rate, and the aggregate over the span of both."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import torch

from kvpool.client.mapped_files import MappedChunkFiles
from kvpool.common import keys
from kvpool.connector.copier import MappedChunks
from kvpool.tools.bench.gpu_caches import ChunkCopies, Rig, batch_size, chunk_bytes, reserve
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN
from kvpool.tools.bench.report import table

TENANT = keys.tenant_id("gpu-bench-shared")
PER_PROCESS_BYTES = 512 << 20


def report(rig: Rig, shared: tuple[str, int], runs: int) -> str:
    name, tokens = shared
    size = chunk_bytes(name, tokens)
    count = batch_size(size, PER_PROCESS_BYTES, 8)
    _, plan = reserve(rig.client, TENANT, 2 * count, size)
    assert plan.lease is not None
    try:
        rows = []
        for processes in (1, 2):
            results = _run(
                processes,
                door=str(rig.files.files.door),
                file=plan.file,
                offsets=plan.offsets,
                name=name,
                tokens=tokens,
                device=rig.device,
                runs=runs,
            )
            spans = [end - start for _, start, end in results]
            total = sum(moved for moved, _, _ in results)
            whole = max(end for _, _, end in results) - min(start for _, start, end in results)
            rows.append(
                [
                    processes,
                    " + ".join(
                        f"{moved / span / 1e9:.1f}"
                        for (moved, _, _), span in zip(results, spans, strict=True)
                    ),
                    f"{total / whole / 1e9:.1f}",
                ]
            )
    finally:
        rig.client.release(plan.lease)
    title = (
        f"processes mapping one segment, {name} {tokens}-token chunks, {count} per process, "
        f"store then load, {runs} rounds"
    )
    return table(title, ["processes", "each GB/s", "aggregate GB/s"], rows)


def _run(
    processes: int,
    *,
    door: str,
    file: int,
    offsets: list[int],
    name: str,
    tokens: int,
    device: torch.device,
    runs: int,
) -> list[tuple[int, float, float]]:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    answers: Any = context.Queue()
    half = len(offsets) // 2
    workers = [
        context.Process(
            target=copy_process,
            kwargs={
                "door": door,
                "file": file,
                "offsets": offsets[i * half : (i + 1) * half],
                "name": name,
                "tokens": tokens,
                "device_type": device.type,
                "runs": runs,
                "index": i,
                "barrier": barrier,
                "answers": answers,
            },
        )
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    results = []
    for _ in workers:
        answer = answers.get(timeout=600)
        if isinstance(answer, str):
            raise SystemExit(answer)
        results.append(answer)
    for worker in workers:
        worker.join(timeout=60)
    return results


def copy_process(
    *,
    door: str,
    file: int,
    offsets: list[int],
    name: str,
    tokens: int,
    device_type: str,
    runs: int,
    index: int,
    barrier: Any,
    answers: Any,
) -> None:
    """One engine's process: map its chunk file, then ``runs`` rounds of storing and
    loading its chunks."""
    try:
        device = torch.device(device_type)
        segment = MappedChunks(MappedChunkFiles(Path(door), ADMIN_TOKEN), (0, 0))
        copies = ChunkCopies.make(name, tokens, len(offsets), device, seed=10 + index)
        size = copies.format.chunk_bytes
        chunks = [segment.chunk(file, offset, size, write=True) for offset in offsets]
        for copy in copies.store(chunks) + copies.load(chunks):  # warm up
            copy.wait()
        barrier.wait()
        started = time.monotonic()
        for _ in range(runs):
            for copy in copies.store(chunks):
                copy.wait()
            for copy in copies.load(chunks):
                copy.wait()
        ended = time.monotonic()
        copies.check(f"process {index}")
        answers.put((2 * runs * len(offsets) * size, started, ended))
        del chunks
        segment.close()
    except BaseException as error:
        answers.put(f"copying process {index} failed: {type(error).__name__}: {error}")
