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
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvpool_agent.bench.report import table
from kvpool_agent.client import AgentClient
from kvpool_agent.keys import tenant_id

TENANT = tenant_id("bench-writeback")
READY = re.compile(r"agent ready pool=\S+ zmq=(\S+) http=(\S+)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=2000, help="stores timed per agent")
    parser.add_argument("--chunk-kib", type=int, default=2048, help="chunk size, KiB")


def _start(workdir: Path, extra: dict[str, str]) -> tuple[subprocess.Popen[str], str, str]:
    env = {
        **os.environ,
        "KVPOOL_L1_SIZE": "1GiB",
        "KVPOOL_ZMQ_PORT": "0",
        "KVPOOL_HTTP_PORT": "0",
        "KVPOOL_EVENTS_PORT": "0",
        "KVPOOL_STATE_DIR": str(workdir),
        **extra,
    }
    process = subprocess.Popen(
        [Path(sys.executable).parent / "kvpool-agent"], env=env, stderr=subprocess.PIPE, text=True
    )
    found: list[tuple[str, str]] = []
    ready = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            match = READY.search(line)
            if match:
                found.append((match.group(1), match.group(2)))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(60) or not found:
        process.kill()
        raise RuntimeError("the agent did not start")
    return process, *found[0]


def _store_latencies(endpoint: str, chunks: int, size: int) -> list[float]:
    payload = os.urandom(size)
    samples = []
    with AgentClient(endpoint, timeout=30) as client:
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
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        root = Path(tmp)
        setups = {
            "idle (no L2)": {},
            "saturated (NVMe, fsync always, queue 8)": {
                "KVPOOL_NVME__PATH": str(root / "nvme"),
                "KVPOOL_NVME__CAPACITY": "8GiB",
                "KVPOOL_NVME__FSYNC": "always",
                "KVPOOL_WRITEBACK_QUEUE_CHUNKS": "8",
            },
        }
        for name, extra in setups.items():
            workdir = root / f"agent-{len(results)}"
            workdir.mkdir()
            segment = Path("/dev/shm") / f"kvpool-bench-wb-{os.getpid()}-{len(results)}"
            process, endpoint, http = _start(
                workdir, {"KVPOOL_SEGMENT_PATH": str(segment), **extra}
            )
            try:
                samples = _store_latencies(endpoint, args.chunks, size)
                metrics = httpx.get(f"{http}/metrics").text
                shed = re.search(r"^kvpool_writeback_shed_total (\S+)$", metrics, re.MULTILINE)
            finally:
                process.terminate()
                process.wait(30)
                segment.unlink(missing_ok=True)
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
    print(f"\np99 saturated / idle = {saturated[1] / idle[1]:.2f} (goal <= 1.2)")
