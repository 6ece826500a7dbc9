"""``kvpool bench spaces``: N tenants sharing one system prompt, each with a question of its
own: the bytes the agent stores and the readers' time to first token, with the system prompt
in a shared space against plain per-tenant salts and against no salt at all.

One real agent (an L1 big enough for every chunk of the largest round: nothing is evicted)
and two vLLM engines in child processes (as ``kvpool bench connector`` runs them, the same
random Llama): ``kvpool``, the connector with the engine token (it acts for every tenant,
as one engine serving many tenants' salts does) and vLLM's prefix cache ON, as users run
it; and ``none`` (no connector, no prefix cache) for the recompute row, the ceiling.

Modes, by the ``cache_salt`` of tenant ``t``'s requests:

* ``plain salts``: its own salt: isolation as without spaces, every tenant stores and
  computes the system prompt;
* ``shared space``: ``shared_salt(space salt, --system-tokens, own salt)``: the system
  prompt's chunks are keyed under the space, the question's under the tenant;
* ``no salt``: one cache for everyone, no isolation at all: the floor.

Each of ``--runs`` runs has, per N of ``--tenants`` and per mode (in an order that turns
with the run), a round: the agent is cleared (admin ``POST /v1/clear``), tenant 0 sends the
system prompt and its question (the writer), then tenants 1..N-1 send theirs one at a time
(the readers: their TTFT, ``max_tokens=1``, is the wall time of the request). With N = 1
there is no other tenant: the reader is tenant 0's second request, with another question
and the same salt (vLLM's own cache serves it in every mode). Then ``GET /v1/status`` gives
the bytes stored. vLLM's own prefix cache is not reset between rounds: every N of every run
has prompts of its own (the same for its three modes, whose salts all differ), so that cache
can help only within a round. The engines start once for all runs, after a warm-up round of
two tenants in each mode.

vLLM keys its own prefix cache on the whole ``cache_salt``: two tenants' structured salts
never share a block there. A reader's cached tokens are split into vLLM's own hits and the
pool's (the connector's ``vllm:kvpool_hit_tokens``): with a shared space the system prompt
comes from the pool, with no salt from vLLM's own cache. The recompute row is
``--recompute`` fresh prompts of the same length per run on the ``none`` engine.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpool.common import keys, problems
from kvpool.tools.bench.connector_engine import (
    Engine,
    Sample,
    add_model_arguments,
    kv_bytes_per_token,
    write_model,
)
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, running_agent
from kvpool.tools.bench.report import command, machine, median_spread, progress, table

MODES = {"plain": "plain salts", "space": "shared space", "none": "no salt"}
SPACE_SALT = "bench-space"
RECOMPUTE = "recompute"
VOCAB = 8000
"""Token ids are drawn below the random model's vocabulary (8192)."""
MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tenants",
        type=_counts,
        default=[1, 8, 64],
        help="comma-separated tenant counts, one round each (default: 1,8,64)",
    )
    parser.add_argument(
        "--system-tokens",
        type=problems.number(int),
        default=4096,
        help="tokens of the shared system prompt (the space's share of each request)",
    )
    parser.add_argument(
        "--question-tokens",
        type=problems.number(int),
        default=256,
        help="tokens of each tenant's own question",
    )
    parser.add_argument(
        "--runs", type=problems.number(int), default=3, help="runs of every mode and N"
    )
    parser.add_argument(
        "--recompute",
        type=problems.number(int),
        default=3,
        help="recomputed requests per run (no cache, no connector): the ceiling",
    )
    parser.add_argument(
        "--chunk-tokens", type=problems.number(int), default=256, help="kvpool chunk size"
    )
    add_model_arguments(parser)


def _counts(text: str) -> list[int]:
    """Tenant counts, each once, in the order given."""
    return list(dict.fromkeys(int(count) for count in problems.numbers(int)(text)))


def salt(mode: str, tenant: int, system_tokens: int) -> str | None:
    """The ``cache_salt`` of tenant ``tenant``'s requests in ``mode``."""
    own = f"bench-tenant-{tenant}"
    if mode == "plain":
        return own
    if mode == "space":
        return keys.shared_salt(SPACE_SALT, system_tokens, own)
    return None


def l1_size(args: argparse.Namespace) -> str:
    """An L1 that holds the largest round with plain salts (every tenant's every chunk)
    below the agent's low watermark, so that nothing is evicted."""
    chunks = max(args.tenants) * math.ceil(_prompt_tokens(args) / args.chunk_tokens)
    stored = chunks * args.chunk_tokens * kv_bytes_per_token(args)
    return f"{math.ceil(stored / 0.75 / MIB) + 64}Mi"


def _prompt_tokens(args: argparse.Namespace) -> int:
    return int(args.system_tokens + args.question_tokens)


def run(args: argparse.Namespace) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-bench-spaces-") as work,
        running_agent({"POOL": "bench-spaces", "L1_SIZE": l1_size(args)}) as agent,
        contextlib.ExitStack() as stack,
    ):
        workdir = Path(work)
        model = workdir / "model"
        write_model(model, argparse.Namespace(**vars(args), prompt_tokens=_prompt_tokens(args)))
        common = {
            "model": str(model),
            "prompt_tokens": _prompt_tokens(args),
            "chunk_tokens": args.chunk_tokens,
        }
        kvpool = Engine(
            {
                **common,
                "config": "kvpool",
                "endpoint": agent.zmq,
                "token": ENGINE_TOKEN,
                "prefix_caching": True,
            },
            workdir / "kvpool.log",
        )
        stack.callback(kvpool.stop)
        recompute = Engine({**common, "config": "none"}, workdir / "none.log")
        stack.callback(recompute.stop)
        kvpool.wait_ready()
        recompute.wait_ready()
        results = measure(kvpool, recompute, Admin(agent.http), args)
    print(report(results, args), flush=True)
    print("\n" + command("kvpool bench spaces", args))
    print(machine())


# ------------------------------------------------------------------ measuring


@dataclass(frozen=True)
class Admin:
    """The agent's admin HTTP API."""

    http: str

    def _call(self, method: str, path: str) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        answer = httpx.request(method, f"{self.http}{path}", headers=headers, timeout=30)
        result: dict[str, Any] = answer.raise_for_status().json()
        return result

    def clear(self) -> None:
        self._call("POST", "/v1/clear")

    def stored_bytes(self) -> int:
        return int(self._call("GET", "/v1/status")["stored_bytes"])


@dataclass(frozen=True)
class Round:
    """One mode at one N in one run: the writer, the readers and what the agent stored."""

    writer: Sample
    readers: list[Sample]
    stored_bytes: int


@dataclass
class Results:
    rounds: dict[tuple[str, int], list[Round]] = field(default_factory=dict)
    """Per (mode, N), its round of each run."""
    recompute: list[list[Sample]] = field(default_factory=list)
    """Per run, the recomputed requests."""


def measure(kvpool: Engine, recompute: Engine, admin: Admin, args: argparse.Namespace) -> Results:
    rng = random.Random(1)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(length)]

    # warm-up: allocator, kernels, the agent connection, a hit from the pool and from vLLM's
    # own cache (the first request on a prefix-cached path is slower)
    modes = list(MODES)
    for mode in modes:
        system = prompt(args.system_tokens)
        questions = [prompt(args.question_tokens) for _ in range(2)]
        _round(kvpool, admin, mode, system=system, questions=questions, tenants=2, args=args)
    for _ in range(2):
        recompute.generate(prompt(_prompt_tokens(args)))
    results = Results()
    for number in range(args.runs):
        progress(f"run {number + 1} of {args.runs}")
        results.recompute.append(
            [recompute.generate(prompt(_prompt_tokens(args))) for _ in range(args.recompute)]
        )
        for tenants in args.tenants:
            system = prompt(args.system_tokens)
            questions = [prompt(args.question_tokens) for _ in range(max(tenants, 2))]
            turn = number % len(modes)
            for mode in modes[turn:] + modes[:turn]:
                one = _round(
                    kvpool,
                    admin,
                    mode,
                    system=system,
                    questions=questions,
                    tenants=tenants,
                    args=args,
                )
                results.rounds.setdefault((mode, tenants), []).append(one)
    return results


def _round(
    engine: Engine,
    admin: Admin,
    mode: str,
    *,
    system: list[int],
    questions: list[list[int]],
    tenants: int,
    args: argparse.Namespace,
) -> Round:
    admin.clear()
    salts = [salt(mode, tenant, args.system_tokens) for tenant in range(tenants)]
    writer = engine.generate(system + questions[0], salts[0])
    if tenants == 1:  # no other tenant: tenant 0 asks again
        readers = [engine.generate(system + questions[1], salts[0])]
    else:
        readers = [
            engine.generate(system + questions[tenant], salts[tenant])
            for tenant in range(1, tenants)
        ]
    return Round(writer, readers, admin.stored_bytes())


# ------------------------------------------------------------------ report


def _reader_medians(rounds: Sequence[Round]) -> list[float]:
    return [statistics.median(s.seconds for s in one.readers) for one in rounds]


def _ratios(values: Sequence[float], bases: Sequence[float]) -> list[float]:
    return [value / base for value, base in zip(values, bases, strict=True)]


def report(results: Results, args: argparse.Namespace) -> str:
    recompute = [statistics.median(s.seconds for s in run) for run in results.recompute]
    shared_chunks = args.system_tokens // args.chunk_tokens
    rows: list[list[str]] = []
    for tenants in args.tenants:
        for mode, label in MODES.items():
            rounds = results.rounds[(mode, tenants)]
            readers = [s for one in rounds for s in one.readers]
            medians = _reader_medians(rounds)
            floor = _reader_medians(results.rounds[("none", tenants)])
            stored = [one.stored_bytes for one in rounds]
            space = [one.stored_bytes for one in results.rounds[("space", tenants)]]
            pool = statistics.median(s.hit_tokens for s in readers)
            own = statistics.median(s.cached - s.hit_tokens for s in readers)
            rows.append(
                [
                    label,
                    str(tenants),
                    str(len(readers)),
                    median_spread([s.seconds for s in readers], "{:.1f}", 1000),
                    median_spread(_ratios(medians, recompute), "{:.3f}"),
                    median_spread(_ratios(medians, floor), "{:.2f}"),
                    median_spread([one.writer.seconds for one in rounds], "{:.1f}", 1000),
                    f"{statistics.median(stored) / MIB:.1f}",
                    median_spread(_ratios(stored, space), "{:.2f}"),
                    f"{own:.0f} / {pool:.0f}",
                ]
            )
    samples = [s.seconds for run in results.recompute for s in run]
    rows.append(
        [RECOMPUTE, "", str(len(samples)), median_spread(samples, "{:.1f}", 1000)] + [""] * 6
    )
    runs = len(results.recompute)
    title = (
        f"Tenants sharing a {args.system_tokens}-token system prompt, each with a "
        f"{args.question_tokens}-token question of its own; {args.chunk_tokens}-token chunks, "
        f"vLLM's prefix cache on; {args.layers}-layer Llama (hidden {args.hidden}); "
        f"{runs} run{'s' if runs > 1 else ''}. TTFT: median [min-max] of all readers; ratios: "
        "median [min-max] of the runs' reader medians over the reference's in the same run"
    )
    header = [
        "mode",
        "tenants",
        "readers",
        "reader TTFT ms",
        "vs recompute",
        "vs no salt",
        "writer TTFT ms",
        "stored MiB",
        "vs space",
        "cached tok/reader vLLM / pool",
    ]
    lines = [table(title, header, rows)]
    lines.append(
        "tenants 1: no other tenant; the reader is tenant 0's second request (another "
        "question, the same salt): vLLM's own prefix cache serves the system prompt"
    )
    lines.append(
        f"recompute: {args.recompute} fresh prompts of {_prompt_tokens(args)} tokens per run "
        "on an engine with no connector and no prefix cache (its column 'readers': requests)"
    )
    lines += _checks(results, args, shared_chunks)
    return "\n".join(lines)


def _checks(results: Results, args: argparse.Namespace, shared_chunks: int) -> list[str]:
    """What the table should show, said in words: yes, or NO where it does not."""
    many = [tenants for tenants in args.tenants if tenants > 1]
    space = [
        s for tenants in many for one in results.rounds[("space", tenants)] for s in one.readers
    ]
    shared = shared_chunks * args.chunk_tokens

    def said(claim: str, holds: bool) -> str:
        return f"{claim}: {'yes' if holds else 'NO'}"

    lines = []
    if space:
        lines.append(
            said(
                f"shared space: every reader loaded the system prompt's {shared_chunks} chunks "
                "from the pool",
                all(s.hit_tokens >= shared for s in space),
            )
        )
        lines.append(
            said(
                "shared space: no reader hit vLLM's own prefix cache (other tenants' salts)",
                all(s.cached == s.hit_tokens for s in space),
            )
        )
    tokens = {
        mode: [
            s.token
            for tenants in args.tenants
            for one in results.rounds[(mode, tenants)]
            for s in [one.writer, *one.readers]
        ]
        for mode in MODES
    }
    lines.append(
        said(
            "first tokens, shared space = no salt (the question computed on the same KV)",
            tokens["space"] == tokens["none"],
        )
    )
    same = sum(a == b for a, b in zip(tokens["plain"], tokens["none"], strict=True))
    lines.append(
        f"first tokens, plain salts = no salt: {same} of {len(tokens['none'])} (plain readers "
        "compute the whole prompt: another kernel path, random weights can flip the argmax)"
    )
    return lines
