"""The tables of ``kvpool bench cluster``: per rate, the isolation runs, per tenant, and P/D.

A figure is the median of its segment's runs (TTFT p50 with their range where there are
several), then its ratio to configuration 1's at the same rate (the P/D table's: to
configuration 4's, the same servers colocated): below 1 is faster for latencies, above 1
is more for throughput.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.tools.bench.cluster.cluster import Flavor
from kvpool.tools.bench.cluster.configs import COLOCATED, Config, names
from kvpool.tools.bench.cluster.interference import Interference
from kvpool.tools.bench.cluster.results import Figures, Segment, percent, ratio, seconds
from kvpool.tools.bench.cluster.workload import NOISY
from kvpool.tools.bench.report import table

Figure = Callable[[Segment], float | None]


@dataclass(frozen=True)
class Runs:
    """The runs of one segment (a configuration, a phase, a rate)."""

    segments: Sequence[Segment]

    def median(self, figure: Figure) -> float | None:
        values = [value for s in self.segments if (value := figure(s)) is not None]
        return statistics.median(values) if values else None

    def spread(self, figure: Figure) -> tuple[float, float] | None:
        """The least and the most of ``figure`` over the runs, where there are several."""
        values = [value for s in self.segments if (value := figure(s)) is not None]
        return (min(values), max(values)) if len(values) > 1 else None

    def cell(
        self,
        figure: Figure,
        base: Runs | None,
        show: Callable[[float | None], str] = seconds,
        *,
        spread: bool = False,
    ) -> str:
        """The median, its range (``spread``), and its ratio to ``base``'s median."""
        middle = self.median(figure)
        shown = show(middle)
        if spread and (bounds := self.spread(figure)):
            shown += f" [{show(bounds[0])}-{show(bounds[1])}]"
        return shown + ratio(middle, base.median(figure) if base else None)

    def share(self, part: Callable[[Segment], int]) -> str:
        """``part`` of the prompt tokens, over every run."""
        return percent(sum(map(part, self.segments)), sum(s.split.prompt for s in self.segments))

    def total(self, figure: Callable[[Segment], int]) -> int:
        return sum(map(figure, self.segments))


def runs(segments: Sequence[Segment], config: int, phase: str, rate: float) -> Runs | None:
    found = [s for s in segments if s.config == config and s.phase == phase and s.rate == rate]
    return Runs(found) if found else None


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _pd(figure: Callable[[Interference], float | None]) -> Figure:
    return lambda s: figure(s.interference) if s.interference else None


def _quiet(figure: Callable[[Figures], float | None]) -> Figure:
    return lambda s: figure(s.quiet)


SWEEP_HEADER = [
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


def sweep_rows(
    segments: Sequence[Segment], configs: Sequence[Config], rate: float, not_run: dict[int, str]
) -> list[list[object]]:
    base = runs(segments, 1, "sweep", rate)
    rows: list[list[object]] = []
    for config in configs:
        found = runs(segments, config.number, "sweep", rate)
        if found is None:
            why = not_run.get(config.number, "not run")
            rows.append([config.number, config.name, why, *[""] * (len(SWEEP_HEADER) - 3)])
            continue
        kvpool = config.flavor in (Flavor.KVPOOL, Flavor.DISAGG)  # agents that are peers
        rows.append(
            [
                config.number,
                config.name,
                found.cell(lambda s: s.all.ttft_p50, base, spread=True),
                found.cell(lambda s: s.all.ttft_p90, base),
                found.cell(lambda s: s.all.ttft_p99, base),
                found.cell(lambda s: s.all.itl_p50, base),
                found.cell(lambda s: s.requests_per_s, base, _rate),
                found.cell(lambda s: s.output_tokens_per_s, base, _tokens),
                found.share(lambda s: s.split.vllm_cache),
                found.share(lambda s: s.split.l1) if config.flavor is not Flavor.PLAIN else "-",
                found.share(lambda s: s.split.peer) if kvpool else "n/a",
                found.share(lambda s: s.split.recomputed),
                found.total(lambda s: s.all.failed),
            ]
        )
    return rows


ISOLATION_HEADER = [
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


def isolation_rows(
    segments: Sequence[Segment], configs: Sequence[Config], rate: float, not_run: dict[int, str]
) -> list[list[object]]:
    """The quiet tenants beside the flood, against the same configuration's sweep at the
    isolation rate (alone)."""
    rows: list[list[object]] = []
    for config in configs:
        alone = runs(segments, config.number, "sweep", rate)
        phases = ("flood", "flood+quotas") if config.flavor is Flavor.KVPOOL else ("flood",)
        for phase in phases:
            found = runs(segments, config.number, phase, rate)
            if found is None:
                why = not_run.get(config.number, "not run")
                rows.append([config.number, config.name, phase, why, *[""] * 5])
                continue
            rows.append(
                [
                    config.number,
                    config.name,
                    phase,
                    alone.cell(_quiet(lambda f: f.ttft_p50), None) if alone else "-",
                    found.cell(_quiet(lambda f: f.ttft_p50), alone, spread=True),
                    found.cell(_quiet(lambda f: f.ttft_p99), None),
                    alone.cell(_quiet(lambda f: f.hit_rate), None, _percent) if alone else "-",
                    found.cell(_quiet(lambda f: f.hit_rate), None, _percent),
                    found.cell(lambda s: s.noisy.ttft_p50 if s.noisy else None, None),
                ]
            )
    return rows


def _tenant(tenant: str, name: str) -> Figure:
    """The figure ``name`` of ``tenant``'s requests in a segment."""

    def figure(segment: Segment) -> float | None:
        found = segment.tenants.get(tenant)
        return None if found is None else getattr(found, name)

    return figure


def tenant_rows(
    segments: Sequence[Segment], configs: Sequence[Config], rate: float
) -> list[list[object]]:
    rows: list[list[object]] = []
    for config in configs:
        for phase in ("sweep", "flood", "flood+quotas"):
            found = runs(segments, config.number, phase, rate)
            if found is None:
                continue
            tenants = sorted({t for s in found.segments for t in s.tenants})
            for tenant in tenants:
                ttft, hits = _tenant(tenant, "ttft_p50"), _tenant(tenant, "hit_rate")
                rows.append(
                    [
                        config.number,
                        phase,
                        tenant,
                        found.cell(ttft, None),
                        found.cell(hits, None, _percent),
                    ]
                )
            if any(s.noisy for s in found.segments):
                rows.append(
                    [
                        config.number,
                        phase,
                        NOISY,
                        found.cell(lambda s: s.noisy.ttft_p50 if s.noisy else None, None),
                        found.cell(lambda s: s.noisy.hit_rate if s.noisy else None, None, _percent),
                    ]
                )
    return rows


PD_HEADER = [
    "#",
    "configuration",
    "decode ITL p50 in prefills",
    "decode ITL p99 in prefills",
    "decode ITL p99",
    "long TTFT p50",
    "long TTFT p99",
    "TTFT p50",
    "TTFT p99",
    "out tok/s",
    "split",
    "failed",
]


def pd_rows(
    segments: Sequence[Segment], configs: Sequence[Config], rate: float
) -> list[list[object]]:
    """Each configuration run on a P/D workload: the decode-heavy requests' gaps during long
    prefills and in all, TTFT, throughput; ``split``: long prompts the picker disaggregated,
    of all, over every run."""
    base = runs(segments, COLOCATED, "sweep", rate)
    rows: list[list[object]] = []
    for config in configs:
        found = runs(segments, config.number, "sweep", rate)
        if found is None or not any(s.interference for s in found.segments):
            continue
        longs = found.total(lambda s: s.interference.long_requests if s.interference else 0)
        rows.append(
            [
                config.number,
                config.name,
                found.cell(_pd(lambda f: f.itl_p50_during), base, _ms),
                found.cell(_pd(lambda f: f.itl_p99_during), base, _ms, spread=True),
                found.cell(_pd(lambda f: f.itl_p99), base, _ms),
                found.cell(_pd(lambda f: f.long_ttft_p50), base, spread=True),
                found.cell(_pd(lambda f: f.long_ttft_p99), base),
                found.cell(lambda s: s.all.ttft_p50, base),
                found.cell(lambda s: s.all.ttft_p99, base),
                found.cell(lambda s: s.output_tokens_per_s, base, _tokens, spread=True),
                f"{found.total(lambda s: s.picks.get('pd', 0))}/{longs}",
                found.total(lambda s: s.all.failed),
            ]
        )
    return rows


def report(
    segments: Sequence[Segment],
    configs: Sequence[Config],
    rates: Sequence[float],
    isolation_rate: float,
    not_run: dict[int, str],
) -> None:
    """Print every table, and whether the answers and the servers' counters agreed."""
    for rate in rates:
        rows = sweep_rows(segments, configs, rate, not_run)
        print(table(f"Rate {rate:g} req/s (ratio to configuration 1)", SWEEP_HEADER, rows))
        print()
    for rate in rates:
        if rows := pd_rows(segments, configs, rate):
            title = (
                f"P/D at {rate:g} req/s: decode-heavy requests' inter-token gaps while long "
                f"prompts are prefilled (ratio to configuration {COLOCATED}, colocated)"
            )
            print(table(title, PD_HEADER, rows))
            print()
    if any(s.phase != "sweep" for s in segments):
        title = f"Isolation: quiet tenants at {isolation_rate:g} req/s, a noisy tenant floods"
        rows = isolation_rows(segments, configs, isolation_rate, {})
        print(table(title, ISOLATION_HEADER, rows))
    for number, why in not_run.items():
        print(f"  {number}. {names()[number]}: {why}")
    print()
    header = ["#", "phase", "tenant", "TTFT p50", "hit rate"]
    rows = tenant_rows(segments, configs, isolation_rate)
    print(table(f"Per tenant at {isolation_rate:g} req/s", header, rows))
    disagreements = [f"{s.config} {s.phase} {s.rate:g}: {p}" for s in segments for p in s.checks]
    print("counters vs answers: " + ("; ".join(disagreements) or "agree in every segment"))
