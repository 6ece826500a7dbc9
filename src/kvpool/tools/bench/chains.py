"""``kvpool bench chains``: how much of a long prompt stored over several steps stays reachable.

vLLM stores a long prompt over several steps (chunked prefill), so the head of
its chain is the oldest part. One chain is stored step by step, each step naming
the last key of the step before as its parent, as the connector does; then the
agent's periodic maintenance runs once. Two chains, each without and with L2
tiers: one bigger than L1 (by default the case of issue 16: 300 MiB of 256 KiB
chunks, 16 a step, into a 256 MiB L1) and one that fits in L1 but not below the
high watermark (236 MiB). The table compares the chunks reachable from the head
(a lookup of the whole chain) with the chunks that fit: the physical limit, and
the low watermark that the maintenance evicts down to. With L2 tiers a chain
bigger than L1 gives up its head, so that the rest of it reaches L1 and L2 (a
prefetch brings the head back): nothing is reachable from the head in L1 alone.

A second table times eviction where it runs most often: ``--prompts`` prompts
stored in turns, one step each (as concurrent requests), by a tenant whose
quota is half of L1 and holds half of them, so once full every chunk stored
evicts one; and checks that every cached chunk is reachable from its head.
"""

from __future__ import annotations

import argparse
import hashlib
import time

from kvpool.agent.core.l1 import L1Cache
from kvpool.agent.core.policies import POLICY_NAMES, policy_factory
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.common import problems
from kvpool.common.keys import tenant_id
from kvpool.common.segment import SegmentLayout
from kvpool.tools.bench.report import table

TENANT = tenant_id("bench")
HIGH, LOW = 0.90, 0.80  # the agent's default watermarks
MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chain-mib", type=problems.number(int), default=300, help="size of the long prompt's KV"
    )
    parser.add_argument(
        "--fitting-mib",
        type=problems.number(int),
        default=236,
        help="size of the prompt's KV that fits in L1",
    )
    parser.add_argument(
        "--l1-mib", type=problems.number(int), default=256, help="size of the L1 segment"
    )
    parser.add_argument(
        "--chunk-kib", type=problems.number(int), default=256, help="size of one chunk"
    )
    parser.add_argument("--page-kib", type=problems.number(int), default=64, help="L1 page size")
    parser.add_argument(
        "--step", type=problems.number(int), default=16, help="chunks stored per step"
    )
    parser.add_argument(
        "--prompts", type=problems.number(int), default=8, help="prompts stored in turns"
    )
    parser.add_argument(
        "--prompt-mib", type=problems.number(int), default=32, help="size of each of them"
    )
    parser.add_argument(
        "--rounds", type=problems.number(int), default=4, help="times the prompts are stored"
    )


def _key(position: int, prompt: int = 0) -> bytes:
    return hashlib.sha256(b"chain/%d/%d" % (prompt, position)).digest()


def _reachable(cache: L1Cache, keys: list[bytes]) -> int:
    return cache.lookup(TENANT, keys, lock=False, count=False).count


def _cache(
    policy: str, args: argparse.Namespace, quota: int | None = None, lower_tier: bool = False
) -> L1Cache:
    cache = L1Cache(
        SegmentLayout.plan(args.l1_mib * MiB, args.page_kib << 10),
        policy_factory(policy),
        QuotaBook(limits={} if quota is None else {TENANT: quota}),
        high_watermark=HIGH,
        low_watermark=LOW,
    )
    cache.lower_tier = lower_tier
    return cache


def _store_step(cache: L1Cache, keys: list[bytes], first: int, args: argparse.Namespace) -> None:
    """Store ``keys[first:first + step]`` under the chunk before it, as the connector does."""
    step = keys[first : first + args.step]
    parent = keys[first - 1] if first else None
    reservation = cache.reserve(TENANT, step, [args.chunk_kib << 10] * len(step), parent)
    if reservation.lease is not None:
        cache.commit(reservation.lease)


def _case(policy: str, chain_mib: int, lower_tier: bool, args: argparse.Namespace) -> list[str]:
    cache = _cache(policy, args, lower_tier=lower_tier)
    layout = cache.layout
    chunk = args.chunk_kib << 10
    keys = [_key(position) for position in range((chain_mib * MiB) // chunk)]
    started = time.perf_counter()
    for first in range(0, len(keys), args.step):
        _store_step(cache, keys, first, args)
    elapsed = time.perf_counter() - started
    stored = cache.stats()
    reachable_stored = _reachable(cache, keys)
    cache.maintain()
    kept = cache.stats()
    reachable_kept = _reachable(cache, keys)
    pages_per_chunk = -(-chunk // layout.page_size)
    fit_all = min(layout.pages // pages_per_chunk, len(keys))
    low_pages = int(layout.pages * LOW)
    fit_low = min(low_pages // pages_per_chunk, len(keys))
    return [
        policy,
        "yes" if lower_tier else "no",
        f"{chain_mib:,}",
        f"{len(keys):,}",
        f"{stored.allocated_bytes / MiB:.1f}",
        f"{reachable_stored:,} / {fit_all:,}",
        f"{kept.allocated_bytes / MiB:.1f} / {low_pages * layout.page_size / MiB:.1f}",
        f"{reachable_kept:,} / {fit_low:,}",
        f"{reachable_kept / fit_low:.2f}",
        f"{elapsed / len(keys) * 1e6:.1f}",
    ]


def _turns(policy: str, args: argparse.Namespace) -> list[str]:
    chunk = args.chunk_kib << 10
    length = (args.prompt_mib * MiB) // chunk
    cache = _cache(policy, args, args.l1_mib * MiB // 2)
    prompts = [
        [_key(position, prompt) for position in range(length)]
        for prompt in range(args.prompts * args.rounds)
    ]
    started = time.perf_counter()
    for round_ in range(args.rounds):
        batch = prompts[round_ * args.prompts : (round_ + 1) * args.prompts]
        for first in range(0, length, args.step):
            for keys in batch:
                _store_step(cache, keys, first, args)
    elapsed = time.perf_counter() - started
    offered = len(prompts) * length
    stats = cache.stats()
    return [
        policy,
        f"{offered:,}",
        f"{sum(_reachable(cache, keys) for keys in prompts):,} / {stats.chunks:,}",
        f"{stats.evictions['quota']:,}",
        f"{elapsed / offered * 1e6:.1f}",
    ]


def run(args: argparse.Namespace) -> None:
    print(
        table(
            f"One chain of {args.chunk_kib} KiB chunks, {args.step} a step,"
            f" into a {args.l1_mib} MiB L1 (watermarks {HIGH:.2f}/{LOW:.2f})",
            [
                "policy",
                "L2 tiers",
                "chain MiB",
                "chunks offered",
                "MiB after stores",
                "reachable / fit in L1",
                "MiB after maintenance / at low watermark",
                "reachable / fit at low watermark",
                "ratio",
                "us per chunk offered",
            ],
            [
                _case(policy, chain_mib, lower_tier, args)
                for chain_mib in (args.chain_mib, args.fitting_mib)
                for lower_tier in (False, True)
                for policy in POLICY_NAMES
            ],
        )
    )
    print()
    print(
        table(
            f"{args.prompts} prompts of {args.prompt_mib} MiB stored in turns, {args.step}"
            f" chunks a step, {args.rounds} times over, into a tenant quota of"
            f" {args.l1_mib // 2} MiB",
            [
                "policy",
                "chunks offered",
                "reachable / cached",
                "quota evictions",
                "us per chunk offered",
            ],
            [_turns(policy, args) for policy in POLICY_NAMES],
        )
    )
