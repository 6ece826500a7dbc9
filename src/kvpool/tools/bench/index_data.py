"""The prefix index the index benches query (``kvpool bench index``, ``kvpool bench route``):
real prompts stored on nodes, synthetic prompt chains filling it to a size, and the timing
helpers both use.

The prompts are :data:`FAMILIES` families of :data:`MEMBERS` prompts that share their first
half (a system prompt), each stored whole on one node under the salt :data:`TENANT`; the
benches query with them (whole prompt cached), with a stored first half and tokens never
seen (half cached), and with prompts never seen (nothing cached).
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvpool.common.keys import ModelFingerprint, chunk_keys
from kvpool.index.tracker import PrefixTracker

T = TypeVar("T")
VOCABULARY = 128_000
FAMILIES = 64
MEMBERS = 4
"""Prompts per family: they share the first half (a system prompt), on MEMBERS nodes."""
TENANT = "bench"
"""The salt every stored prompt's keys are chained under (a tenant's ``cache_salt``)."""


@dataclass(frozen=True)
class Prompts:
    full: list[list[int]]
    """Stored whole on one node (its first half on MEMBERS nodes)."""
    half: list[list[int]]
    """A stored first half, then tokens never seen."""
    miss: list[list[int]]


@dataclass(frozen=True)
class Fill:
    chunks: int
    seconds: float
    """Time spent in ``PrefixTracker.stored`` alone."""
    rss_bytes: int
    """RSS growth while filling, the keys' own objects included."""


def fingerprint(chunk_tokens: int) -> ModelFingerprint:
    """The model every bench prompt is keyed for."""
    return ModelFingerprint("bench-model", "bfloat16", "NHD", chunk_tokens=chunk_tokens)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCABULARY) for _ in range(count)]


def store_prompts(
    tracker: PrefixTracker, fingerprint: ModelFingerprint, nodes: int, tokens: int
) -> Prompts:
    """Store the keys of FAMILIES x MEMBERS real prompts; return prompts to query with."""
    rng = random.Random(11)
    half = tokens // 2
    prompts = Prompts([], [], [])
    for family in range(FAMILIES):
        shared = _tokens(rng, half)
        for member in range(MEMBERS):
            prompt = shared + _tokens(rng, tokens - half)
            node = f"node-{(family + member) % nodes}"
            tracker.stored(node, chunk_keys(prompt, TENANT, fingerprint))
            prompts.full.append(prompt)
        prompts.half.append(shared + _tokens(rng, tokens - half))
        prompts.miss.append(_tokens(rng, tokens))
    return prompts


def tracked(tracker: PrefixTracker) -> int:
    return sum(counts.chunks for counts in tracker.counts().values())


def fill(tracker: PrefixTracker, chunks: int, nodes: int, chain: int) -> Fill:
    """Synthetic prompt chains (``chain`` keys each, round robin over nodes) up to ``chunks``."""
    before = tracked(tracker)
    rss_before = _rss_bytes()
    seconds = 0.0
    clock = time.perf_counter
    for number in range(before, chunks, chain):
        keys = [hashlib.sha256(b"%d" % (number + i)).digest() for i in range(chain)]
        started = clock()
        tracker.stored(f"node-{(number // chain) % nodes}", keys)
        seconds += clock() - started
    return Fill(tracked(tracker) - before, seconds, _rss_bytes() - rss_before)


def quantile(samples: Sequence[float], share: float) -> float:
    """The sample below which ``share`` of them lie (0.5: the median)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def percentiles(samples: list[float]) -> tuple[str, str]:
    """p50 and p99 of ``samples`` (seconds), in microseconds."""
    return f"{quantile(samples, 0.5) * 1e6:.0f} us", f"{quantile(samples, 0.99) * 1e6:.0f} us"


def time_each(action: Callable[[T], object], inputs: Sequence[T], count: int) -> list[float]:
    """Seconds each of ``count`` calls of ``action`` took, on ``inputs`` in turn."""
    samples = []
    clock = time.perf_counter
    for number in range(count):
        argument = inputs[number % len(inputs)]
        started = clock()
        action(argument)
        samples.append(clock() - started)
    return samples
