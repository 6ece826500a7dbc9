"""A segment's figures from its answers and counters, and the bench's tables: each figure
beside its ratio to the baseline (configuration 1) at the same rate."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpool.tools.bench.cluster.driver import Answer
from kvpool.tools.bench.cluster.interference import Interference, interference
from kvpool.tools.bench.cluster.quantiles import quantile
from kvpool.tools.bench.cluster.scrape import Split


@dataclass(frozen=True)
class Figures:
    """Latency and hits of a set of answers."""

    requests: int
    failed: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    hit_rate: float
    """Prompt tokens the servers loaded rather than computed (``cached_tokens``), of all."""


def figures(answers: Sequence[Answer]) -> Figures:
    done = [answer for answer in answers if answer.ok]
    ttfts = [answer.ttft for answer in done if answer.ttft is not None]
    itls = [itl for answer in done if (itl := answer.itl) is not None]
    prompt = sum(answer.prompt_tokens for answer in done)
    return Figures(
        requests=len(answers),
        failed=len(answers) - len(done),
        ttft_p50=quantile(ttfts, 0.5),
        ttft_p90=quantile(ttfts, 0.9),
        ttft_p99=quantile(ttfts, 0.99),
        itl_p50=statistics.median(itls) if itls else None,
        hit_rate=sum(answer.cached_tokens for answer in done) / prompt if prompt else 0.0,
    )


@dataclass(frozen=True)
class Segment:
    """One configuration at one rate (``phase`` "sweep"), or under a flood with or without
    quotas (``phase`` "flood" or "flood+quotas")."""

    config: int
    phase: str
    rate: float
    """The quiet tenants' planned request rate."""
    run: int
    """Which run of the segment (from 0)."""
    achieved_rate: float
    """Requests the quiet tenants sent over the time it took to send them."""
    duration_s: float
    all: Figures
    quiet: Figures
    noisy: Figures | None
    tenants: dict[str, Figures]
    requests_per_s: float
    output_tokens_per_s: float
    split: Split
    picks: dict[str, int]
    first_error: str = ""
    checks: list[str] = field(default_factory=list)
    """What disagreed between the answers and the servers' counters (empty: nothing)."""
    interference: Interference | None = None
    """The P/D figures, of a workload with long and decode-heavy requests."""

    @property
    def name(self) -> str:
        """The segment's files: ``answers-<name>.jsonl``, ``metrics/<name>/``."""
        return segment_name(self.config, self.phase, self.rate, self.run)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self)}


def segment_name(config: int, phase: str, rate: float, run: int) -> str:
    return f"{config}-{phase}-{rate:g}-{run}"


def segment(
    config: int,
    phase: str,
    rate: float,
    run: int,
    answers: Sequence[Answer],
    *,
    split: Split,
    duration_s: float,
) -> Segment:
    """The figures of a segment: its answers, the counters' split, the time it took."""
    quiet = [answer for answer in answers if answer.kind != "flood"]
    noisy = [answer for answer in answers if answer.kind == "flood"]
    done = [answer for answer in answers if answer.ok]
    sends = [answer.sent for answer in quiet]
    achieved = len(sends) / max(sends) if sends and max(sends) > 0 else 0.0
    failures = [answer.error or f"HTTP {answer.status}" for answer in answers if not answer.ok]
    tenants = sorted({answer.tenant for answer in quiet})
    return Segment(
        config=config,
        phase=phase,
        rate=rate,
        run=run,
        achieved_rate=achieved,
        duration_s=duration_s,
        all=figures(answers),
        quiet=figures(quiet),
        noisy=figures(noisy) if noisy else None,
        tenants={t: figures([a for a in quiet if a.tenant == t]) for t in tenants},
        requests_per_s=len(done) / duration_s if duration_s else 0.0,
        output_tokens_per_s=sum(len(a.tokens) for a in done) / duration_s if duration_s else 0.0,
        split=split,
        picks=dict(Counter(answer.pick.split(";", 1)[0] for answer in done if answer.pick)),
        first_error=failures[0] if failures else "",
        checks=checks(answers, split),
        interference=interference(answers),
    )


def checks(answers: Sequence[Answer], split: Split) -> list[str]:
    """Where the client's view (each answer's usage) and the servers' counters disagree."""
    done = [answer for answer in answers if answer.ok]
    problems = []
    prompt = sum(answer.prompt_tokens for answer in done)
    if prompt != split.prompt:
        problems.append(f"usage counts {prompt} prompt tokens, the servers {split.prompt}")
    cached = sum(answer.cached_tokens for answer in done)
    loaded = split.vllm_cache + split.l1 + split.peer
    if cached != loaded:
        problems.append(f"usage counts {cached} cached tokens, the servers {loaded}")
    if len(done) != split.requests:
        problems.append(f"{len(done)} answers, the servers counted {split.requests} requests")
    return problems


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def ratio(value: float | None, base: float | None) -> str:
    """`` (0.31x)``: ``value`` over the baseline's, where both exist."""
    if value is None or base is None or base == 0:
        return ""
    return f" ({value / base:.2f}x)"


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"
