"""The readers of the peer bench (:mod:`benchmarks.peer`): time to first token on host B of
a prompt that host A's engine stored, its KV loaded through the peer tier, through S3, or
recomputed.

Agents: A on host A, with the peer tier and an S3 tier (it writes every chunk back to a
moto server listening at the root namespace's address, over A's link); on host B, one
whose only lower tier is A (``peer``) and one whose only lower tier is S3 (``S3``). The
vLLM engines (child processes of this one, as ``kvpool bench connector`` runs them, the
same random Llama; they stay in the root namespace, reach each agent at its host's
address and map its segment in /dev/shm, as an engine maps its own node's agent's): the
writer on A, a reader on each agent of host B, and one without connector (recompute).

Each run has a fresh prompt: the writer sends it (A's L1 holds it; the write-back to S3 is
waited for), then each reader sends it, the one that goes first turning with the run, then
the recompute engine. A reader's TTFT is its request's wall time (``max_tokens=1``): on B's
miss the connector's lookup starts the prefetch and the scheduler's "not yet, loading"
path waits for it. One untimed warm-up run first.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import re
import time
from collections.abc import Sequence
from pathlib import Path

import boto3
import httpx

from benchmarks.peer_agents import HOLDER, POOL, PULLER, peers_setting
from kvpool.common import problems
from kvpool.common.keyring import generate_key
from kvpool.tools.bench.connector_engine import (
    Engine,
    Sample,
    add_model_arguments,
    kv_bytes_per_token,
    write_model,
)
from kvpool.tools.bench.local.hosts import Hosts
from kvpool.tools.bench.local.s3_server import moto_server
from kvpool.tools.bench.report import median_spread, runs_said, table
from tests.support.agent_process import ENGINE_TOKEN, AgentProcess

WRITER = "writer"
READERS = {"peer": "peer (A's L1, over the link)", "S3": "S3 (moto, root namespace)"}
"""The readers' agents on host B, by the only lower tier each has."""
RECOMPUTE = "recompute"
VOCAB = 8000
"""Token ids are drawn below the random model's vocabulary (8192)."""
BUCKET = "kvpool-bench-peer"
REGION = "us-east-1"
WRITTEN_SECONDS = 120.0
"""The writer's chunks not all in S3 by then: an error."""
MiB = 1 << 20

Run = dict[str, Sample]
"""One run's samples: each reader's and the recompute's, by name."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt-tokens", type=problems.number(int), default=4096, help="tokens of each prompt"
    )
    parser.add_argument(
        "--chunk-tokens", type=problems.number(int), default=256, help="kvpool chunk size"
    )
    parser.add_argument(
        "--skip-ttft", action="store_true", help="no engines: the transfer table alone"
    )
    add_model_arguments(parser)


def measure(hosts: Hosts, workdir: Path, args: argparse.Namespace) -> list[Run]:
    """The timed runs (engines and agents started here, stopped on return)."""
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # moto takes any
        os.environ.setdefault(variable, "kvpool-bench")
    workdir.mkdir()
    with contextlib.ExitStack() as stack:
        endpoint = stack.enter_context(moto_server(host=hosts.root_address))
        boto3.client("s3", endpoint_url=endpoint, region_name=REGION).create_bucket(Bucket=BUCKET)
        agents = _agents(hosts, workdir, endpoint, args)
        for agent in agents.values():
            stack.callback(agent.cleanup)
            agent.start()
        model = workdir / "model"
        write_model(model, args)
        common = {
            "model": str(model),
            "prompt_tokens": args.prompt_tokens,
            "chunk_tokens": args.chunk_tokens,
        }
        engines = {
            name: Engine(
                {**common, "config": "kvpool", "endpoint": agent.zmq, "token": ENGINE_TOKEN},
                workdir / f"{name}.log",
            )
            for name, agent in agents.items()
        }
        engines[RECOMPUTE] = Engine({**common, "config": "none"}, workdir / "recompute.log")
        for engine in engines.values():
            stack.callback(engine.stop)
        for engine in engines.values():
            engine.wait_ready()
        return _runs(engines, agents[WRITER], args)


def _agents(
    hosts: Hosts, workdir: Path, endpoint: str, args: argparse.Namespace
) -> dict[str, AgentProcess]:
    """The writer's agent on host A, the readers' on host B (not started)."""
    a, b = hosts.hosts
    nodes = {HOLDER: a, PULLER: b}
    key_dir = workdir / "peer-keys"
    generate_key(key_dir)
    s3 = {
        "S3__BUCKET": BUCKET,
        "S3__ENDPOINT_URL": endpoint,
        "S3__REGION": REGION,
        "L2_KEY_DIR": str(workdir / "pool-keys"),  # the pool's key, on both nodes
    }
    prompt = args.prompt_tokens * kv_bytes_per_token(args)
    common = {"POOL": POOL, "L1_SIZE": str(math.ceil(4 * prompt / MiB) * MiB + 64 * MiB)}
    settings = {
        WRITER: (a, {**common, **s3, "PEERS": peers_setting(HOLDER, nodes, key_dir)}),
        "peer": (b, {**common, "PEERS": peers_setting(PULLER, nodes, key_dir)}),
        "S3": (b, {**common, **s3}),
    }
    agents = {}
    for name, (host, own) in settings.items():
        (workdir / name).mkdir()
        agents[name] = AgentProcess(workdir / name, own, host=host)
    return agents


def _runs(engines: dict[str, Engine], writer: AgentProcess, args: argparse.Namespace) -> list[Run]:
    rng = random.Random(1)
    readers = list(READERS)
    runs = []
    for number in range(args.runs + 1):  # run 0: the warm-up
        prompt = [rng.randrange(3, VOCAB) for _ in range(args.prompt_tokens)]
        written = _metric(writer.http, "kvpool_writeback_written_total")
        engines[WRITER].generate(prompt)
        _wait_written(writer.http, written + args.prompt_tokens // args.chunk_tokens)
        turn = number % len(readers)
        run = {name: engines[name].generate(prompt) for name in readers[turn:] + readers[:turn]}
        run[RECOMPUTE] = engines[RECOMPUTE].generate(prompt)
        if number:
            runs.append(run)
    return runs


def _metric(http: str, name: str) -> float:
    """The sample ``name`` of the agent's ``/metrics``; 0 if absent."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{http}/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


def _wait_written(http: str, written: float) -> None:
    """Until the write-back has written ``written`` chunks in all and has none pending."""
    deadline = time.monotonic() + WRITTEN_SECONDS
    while (
        _metric(http, "kvpool_writeback_written_total") < written
        or _metric(http, "kvpool_writeback_pending") > 0
    ):
        if time.monotonic() > deadline:
            raise SystemExit(f"agent A's write-back did not reach {written:.0f} chunks in S3")
        time.sleep(0.05)


def report(runs: Sequence[Run], args: argparse.Namespace) -> str:
    chunks = (args.prompt_tokens - 1) // args.chunk_tokens  # vLLM computes the last token
    loaded = chunks * args.chunk_tokens
    recompute = [run[RECOMPUTE].seconds for run in runs]
    rows = []
    for name, label in [*READERS.items(), (RECOMPUTE, "recompute (no connector)")]:
        seconds = [run[name].seconds for run in runs]
        ratios = [mine / base for mine, base in zip(seconds, recompute, strict=True)]
        rows.append(
            [
                label,
                median_spread(seconds, "{:.1f}", 1000),
                median_spread(ratios, "{:.3f}") if name != RECOMPUTE else "",
                median_spread([run[name].hit_tokens for run in runs], "{:.0f}"),
            ]
        )
    mib = loaded * kv_bytes_per_token(args) / MiB
    title = (
        f"Reader TTFT on host B, a {args.prompt_tokens}-token prompt host A's engine stored "
        f"({chunks} chunks of {args.chunk_tokens} tokens to load, {mib:.0f} MiB of KV); "
        f"{args.layers}-layer Llama (hidden {args.hidden}); {runs_said(len(runs))}: ms "
        "median [min-max], ratio per run"
    )
    header = ["reader", "TTFT ms", "vs recompute", "pool tokens"]
    lines = [table(title, header, rows)]
    lines += _checks(runs, loaded)
    return "\n".join(lines)


def _checks(runs: Sequence[Run], loaded: int) -> list[str]:
    """What the table should show, said in words: yes, or NO where it does not."""

    def said(claim: str, holds: bool) -> str:
        return f"{claim}: {'yes' if holds else 'NO'}"

    lines = [
        said(
            f"{name}: every reader loaded {loaded} tokens from the pool",
            all(run[name].hit_tokens >= loaded for run in runs),
        )
        for name in READERS
    ]
    same = sum(run[name].token == run[RECOMPUTE].token for run in runs for name in READERS)
    lines.append(
        f"first tokens, readers = recompute: {same} of {len(READERS) * len(runs)} (the loaded "
        "KV against a whole prompt computed: another kernel path, random weights can flip the "
        "argmax)"
    )
    return lines
