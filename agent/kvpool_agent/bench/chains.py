"""``kvpool bench chains``: how much of a long prompt stored over several steps stays reachable.

vLLM stores a long prompt over several steps (chunked prefill), so the head of
its chain is the oldest part. One chain bigger than L1 (by default the case of
issue 16: 300 MiB of 256 KiB chunks, 16 a step, into a 256 MiB L1) is stored
step by step, each step naming the last key of the step before as its parent,
as the connector does; then the agent's periodic maintenance runs once. The
table compares the chunks reachable from the head (a lookup of the whole chain)
with the chunks that fit: the physical limit, and the low watermark that the
maintenance evicts down to.
"""

from __future__ import annotations

import argparse
import hashlib
import time

from kvpool_agent.bench.report import table
from kvpool_agent.keys import tenant_id
from kvpool_agent.l1 import L1Cache
from kvpool_agent.policies import POLICY_NAMES, policy_factory
from kvpool_agent.quotas import QuotaBook
from kvpool_agent.segment import SegmentLayout

TENANT = tenant_id("bench")
HIGH, LOW = 0.90, 0.80  # the agent's default watermarks
MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chain-mib", type=int, default=300, help="size of the prompt's KV")
    parser.add_argument("--l1-mib", type=int, default=256, help="size of the L1 segment")
    parser.add_argument("--chunk-kib", type=int, default=256, help="size of one chunk")
    parser.add_argument("--page-kib", type=int, default=64, help="L1 page size")
    parser.add_argument("--step", type=int, default=16, help="chunks stored per step")


def _key(position: int) -> bytes:
    return hashlib.sha256(b"chain/%d" % position).digest()


def _reachable(cache: L1Cache, keys: list[bytes]) -> int:
    return cache.lookup(TENANT, keys, lock=False, count=False).count


def _case(policy: str, args: argparse.Namespace) -> list[str]:
    layout = SegmentLayout.plan(args.l1_mib * MiB, args.page_kib << 10)
    cache = L1Cache(
        layout, policy_factory(policy), QuotaBook(), high_watermark=HIGH, low_watermark=LOW
    )
    chunk = args.chunk_kib << 10
    keys = [_key(position) for position in range((args.chain_mib * MiB) // chunk)]
    started = time.perf_counter()
    for first in range(0, len(keys), args.step):
        parent = keys[first - 1] if first else None
        step = keys[first : first + args.step]
        reservation = cache.reserve(TENANT, step, [chunk] * len(step), parent)
        if reservation.lease is not None:
            cache.commit(reservation.lease)
    elapsed = time.perf_counter() - started
    stored = cache.stats()
    reachable_stored = _reachable(cache, keys)
    cache.maintain()
    kept = cache.stats()
    reachable_kept = _reachable(cache, keys)
    pages_per_chunk = -(-chunk // layout.page_size)
    fit_all = layout.pages // pages_per_chunk
    low_pages = int(layout.pages * LOW)
    fit_low = low_pages // pages_per_chunk
    return [
        policy,
        f"{len(keys):,}",
        f"{stored.allocated_bytes / MiB:.1f}",
        f"{reachable_stored:,} / {fit_all:,}",
        f"{kept.allocated_bytes / MiB:.1f} / {low_pages * layout.page_size / MiB:.1f}",
        f"{reachable_kept:,} / {fit_low:,}",
        f"{reachable_kept / fit_low:.2f}",
        f"{elapsed / len(keys) * 1e6:.1f}",
    ]


def run(args: argparse.Namespace) -> None:
    print(
        table(
            f"One {args.chain_mib} MiB chain of {args.chunk_kib} KiB chunks, {args.step} a step,"
            f" into a {args.l1_mib} MiB L1 (watermarks {HIGH:.2f}/{LOW:.2f})",
            [
                "policy",
                "chunks offered",
                "MiB after stores",
                "reachable / fit in L1",
                "MiB after maintenance / at low watermark",
                "reachable / fit at low watermark",
                "ratio",
                "us per chunk offered",
            ],
            [_case(policy, args) for policy in POLICY_NAMES],
        )
    )
