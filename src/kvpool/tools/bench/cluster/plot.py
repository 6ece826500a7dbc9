"""The bench's figure: TTFT p50 against the request rate per configuration, and the quiet
tenants' TTFT alone, beside a flood, and beside it with quotas (left blank without a flood:
the P/D figures are in the tables only); medians of the runs.
Drawn with matplotlib (``kvpool[bench]``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.tools.bench.cluster.results import Segment
from kvpool.tools.bench.cluster.tables import runs

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PHASES = ("sweep", "flood", "flood+quotas")
LABELS = {"sweep": "alone", "flood": "flood", "flood+quotas": "flood, quotas"}


def draw(segments: Sequence[Segment], names: Mapping[int, str], path: Path) -> Path:
    """Two panels in a PNG at ``path``: the rate sweep, and the isolation runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (sweep, isolation) = plt.subplots(1, 2, figsize=(16, 7))
    configs = sorted({s.config for s in segments})
    for config in configs:
        points = []
        for sweep_rate in sorted({s.rate for s in segments if s.config == config}):
            found = runs(segments, config, "sweep", sweep_rate)
            if found is None:
                continue
            sent = found.median(lambda s: s.achieved_rate)
            ttft = found.median(lambda s: s.all.ttft_p50)
            if sent is not None and ttft is not None:
                points.append((sent, ttft))
        if points:
            rates, ttfts = zip(*points, strict=True)
            sweep.plot(rates, ttfts, marker="o", label=f"{config}. {names[config]}")
    sweep.set_yscale("log")
    sweep.set_xlabel("request rate sent (req/s)")
    sweep.set_ylabel("TTFT p50 (s, log)")
    sweep.set_title("TTFT p50 against the request rate")
    sweep.grid(True, which="both", alpha=0.3)
    sweep.legend(fontsize=9)

    rate = next((s.rate for s in segments if s.phase != "sweep"), None)  # isolation
    if rate is None:  # a workload without a flood (P/D): its figures are in the tables
        isolation.set_axis_off()
    else:
        _isolation(isolation, segments, configs, names, rate)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _isolation(
    isolation: Axes,
    segments: Sequence[Segment],
    configs: Sequence[int],
    names: Mapping[int, str],
    rate: float,
) -> None:
    width = 0.8 / len(PHASES)
    for offset, phase in enumerate(PHASES):
        heights: list[float] = []
        positions: list[float] = []
        for position, config in enumerate(configs):
            found = runs(segments, config, phase, rate)
            ttft = found.median(lambda s: s.quiet.ttft_p50) if found else None
            if ttft is not None:
                heights.append(ttft)
                positions.append(position + (offset - 1) * width)
        if heights:
            bars = isolation.bar(positions, heights, width, label=f"quiet tenants, {LABELS[phase]}")
            isolation.bar_label(bars, fmt="%.2f", fontsize=8)
    isolation.set_xticks(range(len(configs)), [f"{c}. {names[c]}" for c in configs], fontsize=8)
    isolation.tick_params(axis="x", rotation=15)
    isolation.set_ylabel("quiet tenants' TTFT p50 (s)")
    isolation.set_title(f"A noisy tenant's flood beside quiet tenants at {rate} req/s")
    isolation.legend(fontsize=9)
