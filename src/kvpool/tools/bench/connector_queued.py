"""The queued-requests part of ``kvpool bench connector``: the connector's scheduler-side time
per engine step while hundreds of requests wait.

vLLM's scheduler walks its waiting queue at every step and asks the connector
``get_num_new_matched_tokens`` for each waiting request it reaches; a request
whose chunks the agent is still prefetching from L2 gets ``None`` and is asked
again at the next step. So the case that costs most is ``--queued`` requests
whose chunks are in L2 but not in L1, submitted at once: every one is asked at
every step until its prefetch is done. The prompts have ``--queued-chunks``
chunks each, enough that loading one from L2 outlasts the scheduler's short
probe (with two small chunks the probe usually sees the prefetch finish, and no
request waits).

One kvpool engine and a private agent with an NVMe L2 in a temporary
directory. The prompts are stored through the engine (``stored``, every lookup
misses), written back to L2, then sent again (``L1 hits``), then the agent's L1
is cleared (the ``clear`` request: L2 keeps the chunks), L2's files are dropped
from the page cache, and the prompts are sent once more (``L2 only``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from pathlib import Path

import httpx

from kvpool.client import AgentClient
from kvpool.tools.bench.connector_engine import Burst, Engine, kv_bytes_per_token
from kvpool.tools.bench.l2 import drop_page_cache
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, running_agent
from kvpool.tools.bench.report import table

WRITEBACK_TIMEOUT_S = 120.0


def measure(model: Path, workdir: Path, args: argparse.Namespace) -> dict[str, Burst]:
    tokens = args.queued_chunks * args.chunk_tokens + 8  # and a few tokens vLLM computes
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 8000) for _ in range(tokens)] for _ in range(args.queued)]
    chunk_bytes = args.chunk_tokens * kv_bytes_per_token(args)
    room = f"{2 * args.queued * args.queued_chunks * chunk_bytes + (256 << 20)}"  # no eviction
    nvme = {"path": str(workdir / "nvme"), "capacity": room}
    with running_agent({"POOL": "bench", "L1_SIZE": room, "NVME": json.dumps(nvme)}) as agent:
        settings = {
            "config": "kvpool",
            "model": str(model),
            "prompt_tokens": tokens,
            "chunk_tokens": args.chunk_tokens,
            "endpoint": agent.zmq,
            "token": ENGINE_TOKEN,
            "max_num_seqs": args.queued_max_seqs,
            "batched_tokens": 2048,
            "time_steps": True,
        }
        engine = Engine(settings, workdir / "queued.log")
        try:
            engine.wait_ready()
            bursts = {"stored": engine.burst(prompts)}
            _wait_written(agent.http, args.queued_chunks * len(prompts))
            bursts["L1 hits"] = engine.burst(prompts)
            with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
                client.clear()  # L1 forgets every chunk; L2 keeps them
            _drop_from_page_cache(workdir / "nvme")
            bursts["L2 only"] = engine.burst(prompts)
        finally:
            engine.stop()
    return bursts


def _wait_written(http: str, chunks: int) -> None:
    """Until the agent has written ``chunks`` chunks back to L2 and has none pending."""
    deadline = time.monotonic() + WRITEBACK_TIMEOUT_S
    while True:
        text = httpx.get(f"{http}/metrics").text
        written = _metric(text, "kvpool_writeback_written_total")
        if written >= chunks and _metric(text, "kvpool_writeback_pending") == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agent wrote {written:.0f} of {chunks} chunks back to L2")
        time.sleep(0.2)


def _drop_from_page_cache(directory: Path) -> None:
    """Make L2 reads come from the device, as they would for chunks written long ago (the
    page cache would serve them from memory, faster than any prefetch probe)."""
    drop_page_cache([path for path in directory.rglob("*") if path.is_file()])


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def report(bursts: dict[str, Burst], args: argparse.Namespace) -> str:
    rows = []
    for case, burst in bursts.items():
        steps = sorted(burst.steps_us)
        rows.append(
            [
                case,
                f"{statistics.median(burst.cached):.0f}",
                len(steps),
                f"{statistics.median(burst.asks):.0f} / {max(burst.asks)}",
                sum(burst.asks),
                burst.deferred,
                f"{statistics.median(steps):.0f}",
                f"{steps[min(len(steps) - 1, int(len(steps) * 0.99))]:.0f}",
                f"{steps[-1]:.0f}",
                f"{sum(steps) / 1000:.1f}",
                f"{burst.seconds:.2f}",
            ]
        )
    title = (
        f"{args.queued} requests submitted at once ({args.queued_chunks} chunks of "
        f"{args.chunk_tokens} tokens + 8 each, max_num_seqs {args.queued_max_seqs}): the "
        "connector's scheduler-side time per engine step"
    )
    header = [
        "chunks",
        "cached tok p50",
        "steps",
        "asks/step p50 / max",
        "asks",
        "of them None",
        "us/step p50",
        "p99",
        "max",
        "total ms",
        "burst s",
    ]
    return table(title, header, rows)
