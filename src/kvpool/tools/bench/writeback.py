"""``kvpool bench writeback``: does a saturated write-back queue slow stores down?

Two real agents with the same L1: one without L2 (idle: nothing to write back)
and one with an NVMe tier that cannot keep up (``fsync: always``, a small
queue), so the queue is full and sheds for the whole run. One client stores
the same stream of chunks into each (prepare, copy, commit; one chunk per
request, as vLLM stores a newly full chunk) and the table compares the store
latency percentiles. Goal: p99 saturated <= 1.2 x idle.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from kvpool.client import AgentClient
from kvpool.common import problems
from kvpool.common.keys import tenant_id
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN, running_agent
from kvpool.tools.bench.report import goal, table

TENANT = tenant_id("bench-writeback")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chunks", type=problems.number(int), default=2000, help="stores timed per agent"
    )
    parser.add_argument(
        "--chunk-kib", type=problems.number(int), default=2048, help="chunk size, KiB"
    )


def _store_latencies(endpoint: str, chunks: int, size: int) -> list[float]:
    payload = os.urandom(size)
    samples = []
    with AgentClient(endpoint, token=ADMIN_TOKEN, timeout=30) as client:
        for i in range(chunks + 50):
            key = hashlib.sha256(b"wb-%d" % i).digest()
            started = time.perf_counter()
            stored = client.store(TENANT, [key], [payload])
            samples.append(time.perf_counter() - started)
            assert stored == 1
    return sorted(samples[50:])


def _percentiles(samples: list[float]) -> tuple[float, float, float]:
    return (
        statistics.median(samples) * 1e3,
        samples[int(len(samples) * 0.99)] * 1e3,
        samples[-1] * 1e3,
    )


def run(args: argparse.Namespace) -> None:
    size = args.chunk_kib << 10
    rows = []
    results: dict[str, tuple[float, float, float]] = {}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:  # NVMe files on a real disk
        setups = {
            "idle (no L2)": {},
            "saturated (NVMe, fsync always, queue 8)": {
                "NVME__PATH": str(Path(tmp) / "nvme"),
                "NVME__CAPACITY": "8Gi",
                "NVME__FSYNC": "always",
                "WRITEBACK_QUEUE_CHUNKS": "8",
            },
        }
        for name, extra in setups.items():
            with running_agent({"L1_SIZE": "1Gi", **extra}) as agent:
                samples = _store_latencies(agent.zmq, args.chunks, size)
                metrics = httpx.get(f"{agent.http}/metrics").text
                shed = re.search(r"^kvpool_writeback_shed_total (\S+)$", metrics, re.MULTILINE)
            results[name] = _percentiles(samples)
            p50, p99, worst = results[name]
            rows.append(
                [name, f"{p50:.2f}", f"{p99:.2f}", f"{worst:.2f}", shed.group(1) if shed else "-"]
            )
    idle, saturated = results.values()
    print(
        table(
            f"L1 store latency, {args.chunks} stores of {args.chunk_kib} KiB (ms)",
            ["write-back", "p50", "p99", "max", "shed"],
            rows,
        )
    )
    ratio = saturated[1] / idle[1]
    print(f"\np99 saturated / idle = {ratio:.2f} ({goal('goal <= 1.2', ratio, 1.2)})")
