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
   venv with lmcache and vLLM), where it runs.

Each configuration runs the workload at each ``--rates`` (after every cache is emptied),
then once more at the isolation rate with a flood of long unique prompts from a noisy
tenant, and for kvpool's configurations once more with every tenant's quota set to
``--quota-share`` of the L1. Tables: TTFT p50/p90/p99, inter-token latency, throughput and
where the prompt tokens came from, each figure with its ratio to configuration 1; the
quiet tenants beside the noisy one; a PNG (``cluster.png``). Raw answers and every
endpoint's ``/metrics`` before and after each segment stay in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpool.common import problems
from kvpool.tools.bench.cluster import plot, workload
from kvpool.tools.bench.cluster.cluster import CHUNK_TOKENS, Cluster, Flavor, Server, Settings
from kvpool.tools.bench.cluster.driver import Answer, Planned, Progress, drive, planned
from kvpool.tools.bench.cluster.results import Segment, percent, ratio, seconds, segment
from kvpool.tools.bench.cluster.scrape import scrape, split
from kvpool.tools.bench.local.models import write_model
from kvpool.tools.bench.report import command, machine, progress, table

SETTLE_S = 2.0
"""After a segment's last answer: vLLM's counters are updated at its next step, and the
agents' stores and peers' fetches finish."""


@dataclass(frozen=True)
class Config:
    number: int
    name: str
    flavor: Flavor
    picker: bool


CONFIGS = (
    Config(1, "round robin, vLLM prefix cache", Flavor.PLAIN, picker=False),
    Config(2, "round robin + kvpool pool", Flavor.KVPOOL, picker=False),
    Config(3, "kvpool picker, vLLM prefix cache", Flavor.PLAIN, picker=True),
    Config(4, "kvpool picker + pool", Flavor.KVPOOL, picker=True),
    Config(5, "round robin + LMCache server", Flavor.LMCACHE, picker=False),
)


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
        default=[1.0, 2.0, 3.0, 4.0],
        help="the quiet tenants' request rates, per second, comma-separated (default "
        "1,2,3,4: up to past where the baseline saturates on two cores)",
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
        help="the configurations to run, comma-separated (default all: 1,2,3,4,5)",
    )
    parser.add_argument("--servers-per-host", type=int, default=2, help="default 2")
    parser.add_argument(
        "--vllm-blocks",
        type=int,
        default=128,
        help="each vLLM server's KV cache in blocks of 128 tokens (default 128)",
    )
    parser.add_argument("--l1", default="512Mi", help="each agent's L1 (default 512Mi)")
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
        "--out",
        type=Path,
        help="where the workload, answers, metrics and plot go (default "
        "./kvpool-bench-cluster-<time>)",
    )


def run(args: argparse.Namespace) -> None:
    out = args.out or Path(f"kvpool-bench-cluster-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.replay is not None:
        load = workload.read_replay(args.replay)
    else:
        load = workload.generate(workload.PRESETS[args.workload], args.seed)
    workload.write_replay(load, out / "workload.jsonl")
    configs = [config for config in CONFIGS if config.number in args.configs]
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
    with bench.cluster:
        for flavor in Flavor:
            chosen = [c for c in configs if c.flavor is flavor and c.number not in not_run]
            if chosen:
                bench.flavor(flavor, chosen)
    results = [s.to_json() for s in bench.segments]
    (out / "results.json").write_text(
        json.dumps({"segments": results, "not_run": not_run, "configs": _names()}, indent=1)
    )
    report(bench.segments, configs, args.rates, isolation_rate, not_run)
    print(f"workload: {load.digest()[:12]} ({out / 'workload.jsonl'}); {machine()}")
    print(command("kvpool bench cluster", args))
    drawn = plot.draw(bench.segments, _names(), out / "cluster.png")
    print(f"plot: {drawn}")


def _names() -> dict[int, str]:
    return {config.number: config.name for config in CONFIGS}


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
        longest = max(len(r.prompt) for r in [*load.requests, *load.flood])
        settings = Settings(
            servers_per_host=args.servers_per_host,
            vllm_blocks=args.vllm_blocks,
            l1_size=args.l1,
            max_model_len=longest + load.params.output_tokens + 16,
            max_num_seqs=8,
            lmcache_python=args.lmcache_python,
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
            for config in configs:
                for rate in self.args.rates:
                    plan = planned(self.load.requests, rate)
                    self.run(config, servers, "sweep", rate, plan)
                self.isolation(config, servers, quotas=False)
                if flavor is Flavor.KVPOOL:
                    self.isolation(config, servers, quotas=True)

    def isolation(self, config: Config, servers: Sequence[Server], *, quotas: bool) -> None:
        """The quiet tenants at the isolation rate, the flood spread over the same time."""
        rate = self.isolation_rate
        quiet = planned(self.load.requests, rate)
        span = max(p.at for p in quiet) or 1.0
        last = max(r.offset for r in self.load.flood) or 1.0
        flood = [Planned(r, r.offset / last * span) for r in self.load.flood]
        plan = sorted([*quiet, *flood], key=lambda p: p.at)
        phase = "flood+quotas" if quotas else "flood"
        self.run(config, servers, phase, rate, plan, quotas=quotas)

    def run(
        self,
        config: Config,
        servers: Sequence[Server],
        phase: str,
        rate: float,
        plan: Sequence[Planned],
        *,
        quotas: bool = False,
    ) -> None:
        name = f"{config.number}-{phase}-{rate:g}"
        cluster = self.cluster
        cluster.reset(servers, config.flavor)
        if quotas:
            cluster.set_quotas(int(self.args.quota_share * _bytes(self.args.l1)))
        endpoints = {f"vllm-{s.address}": s.url for s in servers}
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


def _write_answers(path: Path, answers: Sequence[Answer]) -> None:
    with path.open("w") as file:
        for answer in answers:
            file.write(json.dumps(dataclasses.asdict(answer)) + "\n")


def _bytes(size: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for unit, scale in units.items():
        if size.endswith(unit):
            return int(float(size[: -len(unit)]) * scale)
    return int(size)


def report(
    segments: Sequence[Segment],
    configs: Sequence[Config],
    rates: Sequence[float],
    isolation_rate: float,
    not_run: dict[int, str],
) -> None:
    """The tables: per rate, per tenant, the isolation runs."""
    for rate in rates:
        base = _find(segments, 1, "sweep", rate)
        rows = []
        for config in configs:
            found = _find(segments, config.number, "sweep", rate)
            if found is None:
                rows.append([config.number, config.name, not_run.get(config.number, "not run")])
                continue
            rows.append(_row(config, found, base))
        header = [
            "#",
            "configuration",
            "TTFT p50",
            "TTFT p90",
            "TTFT p99",
            "ITL p50",
            "req/s",
            "out tok/s",
            "vLLM cache",
            "L1",
            "peer",
            "recomputed",
            "failed",
        ]
        print(table(f"Rate {rate:g} req/s (ratio to configuration 1)", header, _pad(rows)))
        print()
    print(_isolation_table(segments, configs, isolation_rate, not_run))
    print()
    print(_tenant_table(segments, configs, isolation_rate))
    problems_found = [f"{s.config} {s.phase} {s.rate:g}: {p}" for s in segments for p in s.checks]
    print("counters vs answers: " + ("; ".join(problems_found) or "agree in every segment"))


def _find(segments: Sequence[Segment], config: int, phase: str, rate: float) -> Segment | None:
    for found in segments:
        if found.config == config and found.phase == phase and found.rate == rate:
            return found
    return None


def _row(config: Config, found: Segment, base: Segment | None) -> list[object]:
    q, b = found.all, base.all if base else None
    s = found.split
    return [
        config.number,
        config.name,
        seconds(q.ttft_p50) + ratio(q.ttft_p50, b.ttft_p50 if b else None),
        seconds(q.ttft_p90) + ratio(q.ttft_p90, b.ttft_p90 if b else None),
        seconds(q.ttft_p99) + ratio(q.ttft_p99, b.ttft_p99 if b else None),
        seconds(q.itl_p50) + ratio(q.itl_p50, b.itl_p50 if b else None),
        f"{found.requests_per_s:.2f}"
        + ratio(found.requests_per_s, base.requests_per_s if base else None),
        f"{found.output_tokens_per_s:.0f}"
        + ratio(found.output_tokens_per_s, base.output_tokens_per_s if base else None),
        percent(s.vllm_cache, s.prompt),
        percent(s.l1, s.prompt) if config.flavor is not Flavor.PLAIN else "-",
        percent(s.peer, s.prompt) if config.flavor is Flavor.KVPOOL else "n/a",
        percent(s.recomputed, s.prompt),
        q.failed,
    ]


def _pad(rows: list[list[object]]) -> list[list[object]]:
    width = max(len(row) for row in rows)
    return [row + [""] * (width - len(row)) for row in rows]


def _isolation_table(
    segments: Sequence[Segment],
    configs: Sequence[Config],
    rate: float,
    not_run: dict[int, str],
) -> str:
    rows: list[list[object]] = []
    for config in configs:
        alone = _find(segments, config.number, "sweep", rate)
        for phase in ("flood", "flood+quotas"):
            found = _find(segments, config.number, phase, rate)
            if found is None:
                if phase == "flood" or config.flavor is Flavor.KVPOOL:
                    rows.append([config.number, config.name, phase, "not run"])
                continue
            quiet, noisy = found.quiet, found.noisy
            rows.append(
                [
                    config.number,
                    config.name,
                    phase,
                    seconds(alone.quiet.ttft_p50) if alone else "-",
                    seconds(quiet.ttft_p50)
                    + ratio(quiet.ttft_p50, alone.quiet.ttft_p50 if alone else None),
                    seconds(quiet.ttft_p99),
                    f"{alone.quiet.hit_rate:.0%}" if alone else "-",
                    f"{quiet.hit_rate:.0%}",
                    seconds(noisy.ttft_p50) if noisy else "-",
                ]
            )
    for number, why in not_run.items():
        rows.append([number, _names()[number], "-", why])
    header = [
        "#",
        "configuration",
        "phase",
        "quiet TTFT p50 alone",
        "quiet TTFT p50 (vs alone)",
        "quiet TTFT p99",
        "quiet hits alone",
        "quiet hits",
        "noisy TTFT p50",
    ]
    title = f"Isolation: quiet tenants at {rate:g} req/s, a noisy tenant floods beside them"
    return table(title, header, _pad(rows))


def _tenant_table(segments: Sequence[Segment], configs: Sequence[Config], rate: float) -> str:
    rows: list[list[object]] = []
    for config in configs:
        for phase in ("sweep", "flood", "flood+quotas"):
            found = _find(segments, config.number, phase, rate)
            if found is None:
                continue
            for tenant, figures in sorted(found.tenants.items()):
                rows.append(
                    [
                        config.number,
                        phase,
                        tenant,
                        seconds(figures.ttft_p50),
                        f"{figures.hit_rate:.0%}",
                        figures.requests,
                    ]
                )
            if found.noisy is not None:
                rows.append(
                    [
                        config.number,
                        phase,
                        workload.NOISY,
                        seconds(found.noisy.ttft_p50),
                        f"{found.noisy.hit_rate:.0%}",
                        found.noisy.requests,
                    ]
                )
    header = ["#", "phase", "tenant", "TTFT p50", "hit rate", "requests"]
    return table(f"Per tenant at {rate:g} req/s", header, rows)
