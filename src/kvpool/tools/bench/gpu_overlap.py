"""Copies beside compute on one GPU, and whether loading layer by layer would shorten a hit.

**Overlap.** bf16 matrix products on the compute stream, sized to last about as long as the
copies, alone and with the copier's stores or loads of other blocks issued just before them:

* ``store``: the copier's side stream waits for the compute issued so far (the blocks are
  computed), not for what follows, so the products run beside it;
* ``load, request waits``: a load for a request that is not in the step's batch (vLLM waits
  for its ``finished_recving``; kvpool's per-request loads): the products run beside it;
* ``load, forward reads``: a load the step's forward reads (kvpool's loads on engines of one
  full-attention group), so the compute stream waits for it: serialized by design.

**Layer by layer.** A hit of one chunk on the Llama-3-8B layout followed by the prefill of
``SUFFIX_TOKENS`` new tokens, each layer's compute one product with that layer's weights
(4096 x 53248, a Llama-3-8B layer's 218 M parameters): loading every layer first and then
computing, against loading layer by layer with each layer's compute waiting only for its own
layer's copy (vLLM's ``wait_for_layer_load``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from kvpool.common import keys
from kvpool.connector.copier import Copy
from kvpool.tools.bench.gpu_caches import (
    ChunkCopies,
    Rig,
    batch_size,
    chunk_bytes,
    kept_ids,
    reserve,
)
from kvpool.tools.bench.report import median_spread, table

TENANT = keys.tenant_id("gpu-bench-overlap")
SUFFIX_TOKENS = 256
HIDDEN, LAYER_OUTPUTS = 4096, 53248
COPY_BYTES = 1 << 30
"""Bytes the overlapped copies move (repeating the chunks as needed)."""


def report(rig: Rig, shared: tuple[str, int], runs: int) -> str:
    name, tokens = shared
    size = chunk_bytes(name, tokens)
    count = batch_size(size, COPY_BYTES, 4)
    _, plan = reserve(rig.client, TENANT, count, size)
    assert plan.lease is not None
    try:
        chunks = [rig.files.chunk(plan.file, offset, size, write=True) for offset in plan.offsets]
        copies = ChunkCopies.make(name, tokens, count, rig.device, seed=20)
        repeats = max(1, COPY_BYTES // (count * size))
        overlap = _overlap(copies, chunks, repeats, rig.device, runs)
        layered = _layer_by_layer(copies, chunks[:1], rig.device, runs)
    finally:
        rig.client.release(plan.lease)
    moved = repeats * count * size
    return "\n\n".join(
        [
            table(
                f"compute beside copies of {moved / 2**30:.1f} GiB ({name}, {tokens}-token chunks)",
                ["copies", "compute ms", "compute / alone", "copies GB/s", "wall ms"],
                [
                    [
                        what,
                        median_spread(compute, "{:.1f}", 1e3),
                        median_spread(
                            [c / a for c, a in zip(compute, overlap["none"][0], strict=True)],
                            "{:.2f}",
                        ),
                        median_spread([moved / s / 1e9 for s in copy], "{:.1f}") if copy else "",
                        median_spread(wall, "{:.1f}", 1e3),
                    ]
                    for what, (compute, copy, wall) in overlap.items()
                ],
            ),
            table(
                f"a hit of one {tokens}-token chunk, then {SUFFIX_TOKENS} new tokens through "
                f"{len(copies.caches.tensors[0])} layers",
                ["schedule", "ms"],
                [[what, median_spread(values, "{:.2f}", 1e3)] for what, values in layered.items()],
            ),
        ]
    )


def _matmuls(device: torch.device) -> Callable[[int], None]:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    out = torch.empty(8192, 8192, device=device, dtype=torch.bfloat16)

    def compute(times: int) -> None:
        for _ in range(times):
            torch.mm(a, b, out=out)

    return compute


def _overlap(
    copies: ChunkCopies,
    chunks: Sequence[torch.Tensor],
    repeats: int,
    device: torch.device,
    runs: int,
) -> dict[str, tuple[list[float], list[float], list[float]]]:
    compute = _matmuls(device)
    compute(3)
    one = _on_compute(device, lambda: compute(10)) / 10
    issue: dict[str, Callable[[], list[Copy]]] = {
        "none": list,
        "store": lambda: [c for _ in range(repeats) for c in copies.store(chunks)],
        "load, request waits": lambda: [
            c for _ in range(repeats) for c in copies.load(chunks, forward_reads=False)
        ],
        "load, forward reads": lambda: [c for _ in range(repeats) for c in copies.load(chunks)],
    }
    alone = _wall(device, lambda: _wait(issue["store"]()))
    times = max(1, round(alone / one))
    results: dict[str, tuple[list[float], list[float], list[float]]] = {
        what: ([], [], []) for what in issue
    }
    for _ in range(runs):
        for what, copy in issue.items():
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            begin, end = _events()
            begin.record()
            issued = copy()
            compute(times)
            end.record()
            finished = _finish(issued, started)
            torch.cuda.synchronize(device)
            wall = time.perf_counter() - started
            spent, copied, walls = results[what]
            spent.append(begin.elapsed_time(end) / 1e3)
            if issued:
                copied.append(finished)
            walls.append(wall)
    return results


def _layer_by_layer(
    copies: ChunkCopies, chunks: Sequence[torch.Tensor], device: torch.device, runs: int
) -> dict[str, list[float]]:
    layers = len(copies.caches.tensors[0])
    weights = torch.randn(HIDDEN, LAYER_OUTPUTS, device=device, dtype=torch.bfloat16)
    hidden = torch.randn(SUFFIX_TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
    out = torch.empty(SUFFIX_TOKENS, LAYER_OUTPUTS, device=device, dtype=torch.bfloat16)
    group = copies.format.groups[0]
    pages = copies.format.views(chunks[0])[0]
    target = kept_ids(copies.format, copies.targets[0])[0]
    index = torch.tensor(target, dtype=torch.long, device=device)
    views = copies.caches.block_views[0]
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def forward(wait: Callable[[int], None] = lambda layer: None) -> None:
        for layer in range(layers):
            wait(layer)
            torch.mm(hidden, weights, out=out)

    def layered() -> None:
        ready = []
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for layer in range(group.layers):
                views[layer].index_copy_(0, index, pages[layer].to(device, non_blocking=True))
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(side)
                ready.append(event)
        forward(lambda layer: torch.cuda.current_stream(device).wait_event(ready[layer]))

    def serial() -> None:
        copies.load(chunks[:1])  # the compute stream waits for it
        forward()

    schedules: dict[str, Callable[[], None]] = {
        "compute alone": forward,
        "load alone": lambda: _wait(copies.load(chunks[:1])),
        "load, then compute": serial,
        "layer by layer": layered,
    }
    for schedule in schedules.values():
        schedule()  # warm up
    results: dict[str, list[float]] = {what: [] for what in schedules}
    for _ in range(runs):
        for what, schedule in schedules.items():
            results[what].append(_wall(device, schedule))
    copies.check("layer-by-layer loads")
    return results


def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return (
        torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
        torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
    )


def _on_compute(device: torch.device, work: Callable[[], None]) -> float:
    begin, end = _events()
    begin.record()
    work()
    end.record()
    torch.cuda.synchronize(device)
    return float(begin.elapsed_time(end)) / 1e3


def _wall(device: torch.device, work: Callable[[], object]) -> float:
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    work()
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _wait(issued: Sequence[Copy]) -> None:
    for copy in issued:
        copy.wait()


def _finish(issued: Sequence[Copy], started: float) -> float:
    """Seconds from ``started`` until the last copy finished (polled, so compute is not held)."""
    while not all(copy.done() for copy in issued):
        time.sleep(0.0002)
    return time.perf_counter() - started
