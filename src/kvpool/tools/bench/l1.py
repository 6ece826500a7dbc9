"""``kvpool bench l1``: in-process cost of the L1 index and of copies into the segment.

* lookup: prefix lookups of 64-chunk chains in an index of ``--chunks`` chunks,
  per chunk (goal <= 1 us);
* reserve+commit and evict: operations per second at that index size;
* metadata: resident bytes per chunk (goal <= 256 B), measured as the growth of
  the process's RSS while the index fills, plus each chunk's key object;
* copy: storing chunks into their tenant's chunk file (reserve, copy, commit) as a ratio to
  a raw memcpy of the same bytes into private memory, same sizes and a working set well
  beyond the CPU caches: where the tenant's file holds the pages already (it stores over its
  own evicted chunks), and where every page moves from another tenant's file (punched there,
  given to this one: each round alternates the two tenants).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import itertools
import mmap
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvpool.agent.core.l1 import L1Cache
from kvpool.agent.core.policies import policy_factory
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.common import problems
from kvpool.common.chunk_files import ChunkFiles
from kvpool.common.names import POLICY_NAMES
from kvpool.common.segment import SegmentLayout, SharedSegment
from kvpool.tools.bench.report import goal, progress, table

CHAIN = 64
LOOKUP = "<= 1 us"
"""The goal of a prefix lookup, per chunk."""
TENANT, OTHER_TENANT = "bench", "bench-other"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chunks", type=problems.number(int), default=1_000_000, help="index size (chunks)"
    )
    parser.add_argument("--policy", choices=POLICY_NAMES, default="lru", help="eviction policy")
    parser.add_argument(
        "--lookups", type=problems.number(int), default=20_000, help="prefix lookups to time"
    )
    parser.add_argument(
        "--copy-mib",
        type=problems.number(int),
        default=512,
        help="working set of the copy test, MiB",
    )


def run(args: argparse.Namespace) -> None:
    print(index_report(args.chunks, args.policy, args.lookups))
    print()
    progress(f"copy: {args.copy_mib} MiB through chunk files vs memcpy")
    print(copy_report(args.copy_mib << 20))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def index_report(chunks: int, policy: str, lookups: int) -> str:
    chunks -= chunks % CHAIN
    keys = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(chunks)]
    page = 4096
    rss_before = _rss_bytes()
    cache = L1Cache(
        SegmentLayout(page_size=page, data_offset=page, data_size=page * (chunks + CHAIN)),
        policy_factory(policy),
        QuotaBook(),
        high_watermark=1.0,
        low_watermark=0.99,
    )
    sizes = [page] * CHAIN
    progress(f"index: filling {chunks:,} chunks")
    started = time.perf_counter()
    for first in range(0, chunks, CHAIN):
        reservation = cache.reserve(TENANT, keys[first : first + CHAIN], sizes)
        assert reservation.lease is not None
        cache.commit(reservation.lease)
    fill_seconds = time.perf_counter() - started
    metadata = (_rss_bytes() - rss_before) / chunks + sys.getsizeof(keys[0])

    progress(f"index: timing {lookups:,} lookups of {CHAIN} chunks")
    rng = random.Random(7)
    chains = [rng.randrange(0, chunks, CHAIN) for _ in range(lookups)]
    # Each lookup is timed on its own and released right after (untimed), as a client does.
    locked = released = 0.0
    clock = time.perf_counter
    for first in chains:
        started = clock()
        hit = cache.lookup(TENANT, keys[first : first + CHAIN])
        looked_up = clock()
        assert hit.lease is not None
        cache.release(hit.lease)
        released += clock() - looked_up
        locked += looked_up - started
    locked_us = locked / (lookups * CHAIN) * 1e6
    release_us = released / (lookups * CHAIN) * 1e6
    started = time.perf_counter()
    for first in chains:
        cache.lookup(TENANT, keys[first : first + CHAIN], lock=False)
    probe_us = (time.perf_counter() - started) / (lookups * CHAIN) * 1e6

    evictions = min(chunks // 2, 200_000)
    progress(f"index: evicting {evictions:,} chunks")
    started = time.perf_counter()
    for _ in range(evictions):
        cache.evict(1)
    evict_seconds = time.perf_counter() - started
    assert cache.stats().chunks == chunks - evictions

    rows = [
        [
            "prefix lookup with read lock, per chunk",
            f"{locked_us:.2f} us",
            goal(LOOKUP, locked_us, 1),
        ],
        ["prefix lookup without lock, per chunk", f"{probe_us:.2f} us", goal(LOOKUP, probe_us, 1)],
        ["release of the read lock, per chunk", f"{release_us:.2f} us", ""],
        ["reserve + commit (batches of 64)", f"{chunks / fill_seconds:,.0f} chunks/s", ""],
        ["evict (one chunk per call)", f"{evictions / evict_seconds:,.0f} chunks/s", ""],
        [
            "metadata per chunk (RSS growth + key)",
            f"{metadata:.0f} B",
            goal("<= 256 B", metadata, 256),
        ],
    ]
    return table(
        f"L1 index, {chunks:,} chunks, policy {policy}", ["measure", "value", "goal"], rows
    )


def copy_report(working_set: int) -> str:
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        segment = SharedSegment.create(Path(tmp) / "bench-segment", working_set, 64 << 10)
        layout = segment.layout
        files = ChunkFiles.open(
            Path(tmp) / "files",
            layout.total_size,
            layout.page_size,
            layout.data_offset,
            adopt=False,
        )
        source = mmap.mmap(
            -1, working_set, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        )
        target = mmap.mmap(
            -1, working_set, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        )
        source.write(os.urandom(1 << 20) * (working_set >> 20))
        source_view = memoryview(source)
        source_address = ctypes.addressof(ctypes.c_char.from_buffer(source))
        target_address = ctypes.addressof(ctypes.c_char.from_buffer(target))
        cache = L1Cache(
            segment.layout,
            policy_factory("lru"),
            QuotaBook(),
            high_watermark=1.0,
            low_watermark=0.99,
            backing=files,
        )
        for chunk in (256 << 10, 2 << 20, 32 << 20):
            count = working_set // chunk
            raw = _best_of(3, _memcpy_all, target_address, source_address, chunk, count)
            store = functools.partial(_store_all, cache, files, source_view, chunk, count)
            store(tenants=iter([TENANT]))  # its pages, once
            held = _best_of(3, store, tenants=itertools.repeat(TENANT))
            moved = _best_of(3, store, tenants=itertools.cycle((OTHER_TENANT, TENANT)))
            rows.append(
                [
                    f"{chunk >> 10} KiB",
                    f"{working_set / raw / 1e9:.2f} GB/s",
                    f"{working_set / held / 1e9:.2f} GB/s",
                    f"{raw / held:.2f}",
                    f"{working_set / moved / 1e9:.2f} GB/s",
                    f"{raw / moved:.2f}",
                ]
            )
        source_view.release()
        files.close()
        segment.close()
    return table(
        f"Store into a chunk file vs raw memcpy, working set {working_set >> 20} MiB",
        ["chunk", "raw memcpy", "its own pages", "ratio", "pages of another", "ratio"],
        rows,
    )


def _memcpy_all(target: int, source: int, chunk: int, count: int) -> None:
    for i in range(count):
        ctypes.memmove(target + i * chunk, source + i * chunk, chunk)


def _store_all(
    cache: L1Cache,
    files: ChunkFiles,
    source: memoryview,
    chunk: int,
    count: int,
    *,
    tenants: Iterator[str],
) -> None:
    """Store ``count`` chunks of the next of ``tenants`` into an emptied cache."""
    tenant = next(tenants)
    cache.clear()
    view = files.view(tenant)
    for i in range(count):
        key = hashlib.sha256(b"%d-%d" % (chunk, i)).digest()
        reservation = cache.reserve(tenant, [key], [chunk])
        placement = reservation.placements[0]
        assert placement is not None and reservation.lease is not None
        view[placement.offset : placement.offset + chunk] = source[i * chunk : (i + 1) * chunk]
        cache.commit(reservation.lease)


def _best_of(repeats: int, action: Callable[..., None], *args: Any, **keywords: Any) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        action(*args, **keywords)
        best = min(best, time.perf_counter() - started)
    return best
