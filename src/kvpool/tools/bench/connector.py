"""``kvpool bench connector``: time to first token with our vLLM connector, without one, with
vLLM's ExampleConnector and with vLLM's own prefix cache; the connector's cost at 0% hits; and
its scheduler-side time per step with many requests queued.

One engine configuration per child process (same model, same engine settings):
``none`` (no connector: every prefill is computed), ``kvpool`` (our connector
and a private ``kvpool-agent``, or ``--endpoint``, with an engine's token and the node's
pool directory: chunk files from the door, the probe table), ``tenant`` (the same with an
agent of its own, as a wired tenant's pod: a tenant's token, the door only, no probe
table), ``inline`` (the same in a process that reaches no door: KV travels in the agent's
messages; with ``--endpoint`` it shares that agent with ``kvpool``), ``example`` (vLLM's
built-in ExampleConnector, its disk-based reference, in a temporary directory)
and ``native`` (no connector, vLLM's own prefix cache on). vLLM's prefix cache
is off in the first four, so a repeated prompt is served from the external
cache, as it would be in another engine or after vLLM evicted it; ``native``
is a hit with the same compute and no transfer at all, the floor of any cache.

The model is a Llama with random weights (``--layers``, ``--hidden`` ...), big
enough that prefill dominates. Each of ``--runs`` runs starts its engines anew
(a process's own speed differs by a few percent from another's with the same
work, here up to ±8%: where its pages and threads land), warms them up, and has
``--requests`` rounds of:

* **repeated prefix**: one ``--prompt-tokens`` prompt (stored by a first,
  untimed request), ``max_tokens=1``, TTFT = the wall time of the request; and
  the **floor**, a fresh prompt of one chunk on the ``none`` engine: the
  prefill vLLM must still compute on a hit;
* **0% hit rate**: a fresh prompt of the same length: every lookup misses and
  every chunk is stored, the connector's pure overhead.

Each round sends the same prompt to every engine back to back, starting with a
different engine each round, so a busy machine slows all of them alike; ratios
are medians of per-round (paired) ratios. Across runs the report gives the
median and the spread (min-max) of the per-run figures, so the median is over
as many sets of processes as runs.

Then ``--queued`` requests at once on a fresh kvpool engine (see
:mod:`kvpool.tools.bench.connector_queued`).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.common import problems
from kvpool.common.keys import tenant_id
from kvpool.common.segment import door_path
from kvpool.tools.bench import connector_queued
from kvpool.tools.bench.connector_engine import (
    Engine,
    Sample,
    add_model_arguments,
    kv_bytes_per_token,
    write_model,
)
from kvpool.tools.bench.local.agent_process import ENGINE_TOKEN, running_agent
from kvpool.tools.bench.report import goal, machine, median_spread, progress, table

CONFIGS = ("none", "kvpool", "tenant", "inline", "example", "native")
_WITH_AGENT = ("kvpool", "tenant", "inline")
TENANT_TOKEN = "bench-tenant-token-6a2f9d14e8c07b35"
"""The ``tenant`` engine's token: a KVCacheTenant's, of its agent's tokens file."""
FLOOR = "floor"
"""The row of one-chunk prompts, served by the ``none`` engine."""
FLOOR_GOAL = 1.25
OVERHEAD_GOAL = 0.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--configs", type=_configs, default=",".join(CONFIGS), help="comma-separated subset"
    )
    parser.add_argument(
        "--prompt-tokens", type=problems.number(int), default=2048, help="tokens per prompt"
    )
    parser.add_argument(
        "--requests", type=problems.number(int), default=8, help="timed rounds per run"
    )
    parser.add_argument(
        "--runs",
        type=problems.number(int),
        default=1,
        help="TTFT runs, each on engines started anew",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=problems.number(int),
        default=128,
        help="kvpool chunk size (default: one CPU block, the ExampleConnector's granularity)",
    )
    add_model_arguments(parser)
    parser.add_argument("--endpoint", help="use this running agent instead of a private one")
    parser.add_argument(
        "--queued",
        type=problems.number(int, zero=True),
        default=256,
        help="requests submitted at once for the per-step scheduler time (0: skip)",
    )
    parser.add_argument(
        "--queued-chunks",
        type=problems.number(int),
        default=8,
        help="chunks per queued prompt (enough that a prefetch from L2 outlasts the probe)",
    )
    parser.add_argument(
        "--queued-max-seqs",
        type=problems.number(int),
        default=64,
        help="max_num_seqs of the queued engine",
    )


def _token(config: str, endpoint: str | None) -> str | None:
    """The connector's token: a tenant's for ``tenant``; an engine's for the other private
    agents (with ``--endpoint``, the one in KVPOOL_CONNECTOR_TOKEN)."""
    if config == "tenant":
        return TENANT_TOKEN
    return None if endpoint else ENGINE_TOKEN


def _configs(text: str) -> list[str]:
    configs = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    return configs


def run(args: argparse.Namespace) -> None:
    configs = args.configs
    copy_rate = memcpy_rate()
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-bench-connector-") as work,
        contextlib.ExitStack() as agent,
    ):
        workdir = Path(work)
        model = workdir / "model"
        write_model(model, args)
        # an agent of its own per kvpool engine, so that neither hits the other's chunks
        # (--endpoint: the one given, with the token from KVPOOL_CONNECTOR_TOKEN)
        endpoints: dict[str, str] = {}
        doors: dict[str, str] = {}
        for config in set(_WITH_AGENT) & set(configs):
            if args.endpoint and config != "tenant":
                endpoints[config] = args.endpoint
                continue
            started = agent.enter_context(
                running_agent(
                    {"POOL": f"bench-{config}", "L1_SIZE": "2Gi"},
                    tenant_tokens={tenant_id(None): TENANT_TOKEN},
                )
            )
            endpoints[config], doors[config] = started.zmq, str(door_path(started.segment_path))
        rng = random.Random(1)
        runs = []
        for number in range(args.runs):
            progress(f"run {number + 1} of {args.runs}: {len(configs)} engines")
            engines: list[Engine] = []
            try:
                for config in configs:
                    settings = {
                        "config": config,
                        "model": str(model),
                        "prompt_tokens": args.prompt_tokens,
                        "chunk_tokens": args.chunk_tokens,
                        "endpoint": endpoints.get(config),
                        "door": doors.get(config),
                        "token": _token(config, args.endpoint),
                        "storage": str(workdir / "example"),
                    }
                    engines.append(Engine(settings, workdir / f"{config}.log"))
                for engine in engines:
                    engine.wait_ready()
                runs.append(_measure(engines, args, rng))
            finally:
                for engine in engines:
                    engine.stop()
        agent.close()  # the queued part has its own agent
        print(report(runs, args, copy_rate), flush=True)
        if args.queued > 0:
            bursts = connector_queued.measure(model, workdir, args)
            print("\n" + connector_queued.report(bursts, args))
    print("\n" + machine())


# ------------------------------------------------------------------ measuring


@dataclass
class Run:
    """One TTFT measurement: per row (a config, or the floor), its samples in round order."""

    repeated: dict[str, list[Sample]] = field(default_factory=dict)
    misses: dict[str, list[Sample]] = field(default_factory=dict)


def _measure(engines: list[Engine], args: argparse.Namespace, rng: random.Random) -> Run:
    """One run of round-robin rounds on fresh engines, one request at a time."""

    def prompt(length: int) -> list[int]:
        return [rng.randrange(3, 8000) for _ in range(length)]

    slots = [(engine.config, engine) for engine in engines]
    slots += [(FLOOR, engine) for engine in engines if engine.config == "none"]
    for _ in range(2):  # warm-up: allocator, kernels, the agent connection
        warm = prompt(args.prompt_tokens)
        for name, engine in slots:
            engine.generate(prompt(args.chunk_tokens) if name == FLOOR else warm)
    shared = prompt(args.prompt_tokens)
    for engine in engines:
        engine.generate(shared)  # computed (and stored, where something stores)
    run = Run()
    for round_ in range(args.requests):
        order = slots[round_ % len(slots) :] + slots[: round_ % len(slots)]
        one_chunk = prompt(args.chunk_tokens)
        for name, engine in order:
            sample = engine.generate(one_chunk if name == FLOOR else shared)
            run.repeated.setdefault(name, []).append(sample)
        fresh = prompt(args.prompt_tokens)
        for name, engine in order:
            if name != FLOOR:
                run.misses.setdefault(name, []).append(engine.generate(fresh))
    return run


def memcpy_rate(size: int = 64 << 20, repeats: int = 9) -> float:
    """Bytes per second of one thread copying a buffer far bigger than the caches (median)."""
    import numpy as np

    source = np.ones(size, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # fault the pages in
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        seconds.append(time.perf_counter() - started)
    return size / statistics.median(seconds)


# ------------------------------------------------------------------ report


def _paired(
    runs: list[Run], scenario: str, row: str, reference: str, pair: Callable[[float, float], float]
) -> list[float] | None:
    """Per run, the median over rounds of ``pair(row's TTFT, reference's TTFT)``."""
    per_run = []
    for run in runs:
        samples = getattr(run, scenario)
        if row not in samples or reference not in samples:
            return None
        per_run.append(
            statistics.median(
                pair(sample.seconds, base.seconds)
                for sample, base in zip(samples[row], samples[reference], strict=True)
            )
        )
    return per_run


def paired_ratios(runs: list[Run], scenario: str, row: str, reference: str) -> list[float] | None:
    return _paired(runs, scenario, row, reference, lambda value, base: value / base)


def _difference(runs: list[Run], scenario: str, row: str, reference: str) -> list[float] | None:
    return _paired(runs, scenario, row, reference, lambda value, base: value - base)


def _held(row: str, values: list[float] | None, form: str, most: float) -> str:
    """``values`` as :func:`median_spread` shows them; kvpool's (the row held to a goal)
    marked where their median is above ``most``."""
    shown = median_spread(values, form)
    if row != "kvpool" or not values:
        return shown
    return goal(shown, statistics.median(values), most)


def ttfts(runs: list[Run], scenario: str, row: str) -> list[float]:
    return [statistics.median(s.seconds for s in getattr(run, scenario)[row]) for run in runs]


def report(runs: list[Run], args: argparse.Namespace, copy_rate: float) -> str:
    rows = list(runs[0].repeated)
    spread = f"median [min-max] of {len(runs)} runs" if len(runs) > 1 else "1 run"
    title = (
        f"Reader TTFT, repeated prefix: {args.layers}-layer Llama (hidden {args.hidden}), "
        f"{args.prompt_tokens}-token prompt, {args.chunk_tokens}-token chunks, "
        f"{args.requests} rounds per run, {spread}"
    )
    header = ["reader", "cached tok", "TTFT ms", "vs floor", "vs native", "vs recompute"]
    lines = [
        table(
            title,
            header,
            [
                [
                    row,
                    f"{statistics.median(s.cached for r in runs for s in r.repeated[row]):.0f}",
                    median_spread(ttfts(runs, "repeated", row), "{:.1f}", 1000),
                    _held(row, paired_ratios(runs, "repeated", row, FLOOR), "{:.2f}", FLOOR_GOAL),
                    median_spread(paired_ratios(runs, "repeated", row, "native"), "{:.2f}"),
                    median_spread(paired_ratios(runs, "repeated", row, "none"), "{:.3f}"),
                ]
                for row in rows
            ],
        )
    ]
    tenant = paired_ratios(runs, "repeated", "tenant", "kvpool")
    if tenant is not None:
        lines.append(
            "tenant / kvpool (paired: a tenant's pod, door only, against an engine's): "
            + median_spread(tenant, "{:.3f}")
        )
    lines += _copy_lines(runs, args, copy_rate)
    lines += ["", _overhead_table(runs, spread)]
    if "kvpool" in runs[0].misses:
        lines += ["", _own_time_table(runs)]
    tokens = {
        tuple(s.token for run in runs for s in run.repeated[row] + run.misses[row])
        for row in runs[0].misses
    }
    lines.append("first tokens identical across configs: " + ("yes" if len(tokens) == 1 else "NO"))
    return "\n".join(lines)


def _copy_lines(runs: list[Run], args: argparse.Namespace, copy_rate: float) -> list[str]:
    """kvpool's time above vLLM's own hit, against the memcpy time of the bytes it loaded."""
    extra = _difference(runs, "repeated", "kvpool", "native")
    if extra is None:
        return []
    cached = statistics.median(s.cached for run in runs for s in run.repeated["kvpool"])
    loaded = cached * kv_bytes_per_token(args)
    copy_ms = loaded / copy_rate * 1000
    extra_ms = statistics.median(extra) * 1000
    return [
        f"kvpool - native (paired): {median_spread(extra, '{:.1f}', 1000)} ms; loaded "
        f"{loaded / 1e6:.1f} MB, whose memcpy at {copy_rate / 1e9:.1f} GB/s (one thread, "
        f"64 MiB buffer, median of 9) takes {copy_ms:.1f} ms: {extra_ms - copy_ms:.1f} ms "
        "above the copy",
        f"goal: TTFT <= {FLOOR_GOAL}x floor",
    ]


def _overhead_table(runs: list[Run], spread: str) -> str:
    """0% hits: each config's TTFT against a recompute on the same fresh prompts."""
    rows = []
    for row in runs[0].misses:
        difference = _difference(runs, "misses", row, "none")
        recompute = ttfts(runs, "misses", "none") if difference is not None else None
        share = (
            [d / r for d, r in zip(difference, recompute, strict=True)]
            if difference is not None and recompute is not None
            else None
        )
        rows.append(
            [
                row,
                median_spread(ttfts(runs, "misses", row), "{:.1f}", 1000),
                "" if row == "none" else median_spread(difference, "{:+.1f}", 1000),
                "" if row == "none" else _held(row, share, "{:+.1%}", OVERHEAD_GOAL),
            ]
        )
    title = (
        f"0% hit rate (fresh prompts, every chunk stored), {spread}; "
        f"goal for kvpool: <= {OVERHEAD_GOAL:.0%} of the recompute TTFT"
    )
    header = ["config", "TTFT ms", "vs none ms (paired p50)", "vs none % of recompute"]
    return table(title, header, rows)


def _own_time_table(runs: list[Run]) -> str:
    """The kvpool connector's own time per request, split by its ``*_us`` counters."""
    rows = []
    for scenario, label in (("repeated", "hit (repeated prefix)"), ("misses", "0% hits")):
        samples = [s for run in runs for s in getattr(run, scenario)["kvpool"]]
        hashing = any("hash_us" in s.connector_us for s in samples)

        def ms(of: Callable[[Sample], int], samples: list[Sample] = samples) -> str:
            return f"{statistics.median(of(s) for s in samples) / 1000:.2f}"

        rows.append(
            [
                label,
                ms(lambda s: s.spent_us("hash_us")) if hashing else "n/a",
                ms(lambda s: s.spent_us("scheduler_us") - s.spent_us("hash_us")),
                ms(lambda s: s.spent_us("load_us")),
                ms(lambda s: s.spent_us("store_us")),
                ms(lambda s: sum(s.spent_us(n) for n in ("scheduler_us", "load_us", "store_us"))),
            ]
        )
    title = (
        "kvpool connector's own time per request, ms (median of all requests, from its "
        "vllm:kvpool_*_us counters; lookup = scheduler side - hashing)"
    )
    return table(title, ["requests", "hashing", "lookup", "load", "store", "total"], rows)
