"""Prefill/decode interference: the inter-token gaps of the decode-heavy requests while long
prompts are prefilled, and the long prompts' time to first token.

A long prompt's prefill window runs from its send to its first token, as the client saw
them: its queueing, its prefill and, disaggregated, the hop to the prefill pod and the
transfer. While one is open, a colocated server computes that prompt between its decode
steps, and the gaps between the tokens it streams to the decode-heavy requests stretch;
a disaggregated decode pod never computes it. A gap counts as *during a prefill* when it
overlaps such a window. The percentiles are over the gaps themselves, not over a mean per
request: a p99 of means hides the one long step that a user sees as a stall.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.tools.bench.cluster.driver import Answer
from kvpool.tools.bench.cluster.quantiles import quantile

LONG = "long"
DECODE = "decode"
"""The workload's request kinds (:mod:`.workload`) this compares."""

Span = tuple[float, float]
"""Seconds from the segment's start: (from, to)."""
READ_S = 0.001
"""Chunks that arrive closer together than this came in one read: the client was behind,
not the server that fast (a decode step of the bench's model takes milliseconds, and this
machine's cores run the load, Envoy and the sidecar too). Counted as one arrival, or the
bursts would put the median gap at zero."""


@dataclass(frozen=True)
class Interference:
    """The decode-heavy requests' gaps and the long prompts' TTFT of one segment."""

    long_requests: int
    decode_requests: int
    gaps: int
    """The decode-heavy answers' gaps between streamed chunks."""
    gaps_during: int
    """Of them, those that overlap a long prompt's prefill window."""
    itl_p50_during: float | None
    itl_p99_during: float | None
    itl_p50: float | None
    """Over every decode-heavy gap."""
    itl_p99: float | None
    long_ttft_p50: float | None
    long_ttft_p99: float | None


def gaps(answer: Answer) -> list[Span]:
    """The gaps between the reads that brought ``answer``'s chunks after its first token."""
    times = [answer.sent + t for t in answer.token_times]
    return [(a, b) for a, b in itertools.pairwise(times) if b - a >= READ_S]


def prefill_windows(answers: Sequence[Answer]) -> list[Span]:
    """Each answered long prompt's send to its first token."""
    return [
        (a.sent, a.sent + a.ttft) for a in answers if a.kind == LONG and a.ok and a.ttft is not None
    ]


def interference(answers: Sequence[Answer]) -> Interference | None:
    """The figures of ``answers``; None without both long and decode-heavy requests."""
    long = [a for a in answers if a.kind == LONG]
    decode = [a for a in answers if a.kind == DECODE]
    if not long or not decode:
        return None
    windows = prefill_windows(answers)
    spans = [span for a in decode if a.ok for span in gaps(a)]
    during = [b - a for a, b in spans if any(a < end and b > start for start, end in windows)]
    every = [b - a for a, b in spans]
    ttfts = [end - start for start, end in windows]
    return Interference(
        long_requests=len(long),
        decode_requests=len(decode),
        gaps=len(every),
        gaps_during=len(during),
        itl_p50_during=quantile(during, 0.5),
        itl_p99_during=quantile(during, 0.99),
        itl_p50=quantile(every, 0.5),
        itl_p99=quantile(every, 0.99),
        long_ttft_p50=quantile(ttfts, 0.5),
        long_ttft_p99=quantile(ttfts, 0.99),
    )
