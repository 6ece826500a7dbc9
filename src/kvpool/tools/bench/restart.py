"""``kvpool bench restart``: how long a restarted agent takes to adopt a full segment.

Fills a segment through the L1 cache (with its chunk table, as the agent
does), drops the cache and the mapping as a crashed agent would, then times
what a new agent does before serving: map and check the segment, read the
chunk table, rebuild index, allocator, chains and tenant usage. Two cases: a
full 1 GiB segment of 256 KiB chunks, and an index of 1M 4 KiB chunks.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

from kvpool.agent.core.journal import SegmentJournal
from kvpool.agent.core.l1 import L1Cache
from kvpool.agent.core.policies import policy_factory
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.common import problems
from kvpool.common.keys import tenant_id
from kvpool.common.segment import SharedSegment
from kvpool.tools.bench.report import table

BATCH = 64
TENANT = tenant_id("bench")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--index-chunks", type=problems.number(int), default=1_000_000, help="chunks, second case"
    )


def _cache(segment: SharedSegment, journal: SegmentJournal) -> L1Cache:
    return L1Cache(
        segment.layout,
        policy_factory("lru"),
        QuotaBook(),
        high_watermark=1.0,
        low_watermark=0.99,
        journal=journal,
    )


def _case(path: Path, data_size: int, page: int, chunk: int, chunks: int) -> list[str]:
    segment, _ = SharedSegment.open(path, data_size, page)
    journal = SegmentJournal(segment)
    cache = _cache(segment, journal)
    for first in range(0, chunks, BATCH):
        count = min(BATCH, chunks - first)
        keys = [hashlib.sha256(b"%d" % (first + i)).digest() for i in range(count)]
        reservation = cache.reserve(TENANT, keys, [chunk] * count)
        assert reservation.lease is not None, reservation.refused_reason
        cache.commit(reservation.lease)
    del cache
    journal.close()
    segment.close()

    started = time.perf_counter()
    segment, recreated = SharedSegment.open(path, data_size, page)
    opened = time.perf_counter()
    journal = SegmentJournal(segment)
    cache = _cache(segment, journal)
    report = cache.restore(journal.committed())
    finished = time.perf_counter()
    assert recreated is None and report.restored == chunks and report.discarded == 0
    journal.close()
    segment.close()
    return [
        f"{data_size >> 20} MiB, {chunks:,} x {chunk >> 10} KiB",
        f"{opened - started:.3f}",
        f"{finished - opened:.3f}",
        f"{finished - started:.3f}",
        f"{(finished - opened) / chunks * 1e6:.2f}",
    ]


def run(args: argparse.Namespace) -> None:
    path = Path("/dev/shm") / f"kvpool-bench-restart-{os.getpid()}"
    try:
        rows = [_case(path, 1 << 30, 64 << 10, 256 << 10, int((1 << 30) * 0.99) // (256 << 10))]
        path.unlink()
        chunks = args.index_chunks
        rows.append(_case(path, (chunks + BATCH) * 4096, 4096, 4096, chunks))
    finally:
        path.unlink(missing_ok=True)
    print(
        table(
            "Warm restart: adopt a segment and rebuild the index (seconds)",
            ["segment", "map + check", "rebuild index", "total", "us per chunk"],
            rows,
        )
    )
