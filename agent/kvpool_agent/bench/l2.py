"""``kvpool bench l2``: the L2 adapters against the raw I/O they wrap, in the same run.

NVMe: the adapter's put and get of ``--nvme-mib`` of chunks against plain file
writes and reads of the same bytes: same chunk sizes, fsync setting, threads
(``--concurrency``) and filesystem (``--nvme-dir``); with ``--direct-io`` both
sides use O_DIRECT. Before the reads every file is synced and dropped from the
page cache (``posix_fadvise(DONTNEED)``), so both sides read from the device.
Goal: adapter >= 0.9 of raw.

S3: the adapter's put and get against raw boto3 ``put_object``/``get_object``
with the same client settings and threads, against the same endpoint: a moto
server started here on 127.0.0.1 (in its own process), or ``--s3-endpoint`` and
``--s3-bucket``. The adapter is measured as the raw calls work, one request per
object (goal: >= 0.8), and for chunks from the default ``multipart_threshold``
also with its default parallel parts and ranges (for information: they pay off
against S3's per-connection limits, while moto re-reads a whole object for
every range).

Shared disks and servers drift by several times within seconds, so the sides
take turns in groups of ``--group-mib`` (the side that goes first alternates),
each side's time is summed over the groups, and each figure is the best of
``--repeats`` such runs after an untimed warm-up run. Every read is checked
against what was written.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import mmap
import os
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import boto3
from botocore.config import Config

from kvpool_agent.bench.report import table
from kvpool_agent.config import NvmeTierConfig, S3TierConfig
from kvpool_agent.keys import tenant_id
from kvpool_agent.l2 import layout
from kvpool_agent.l2.base import L2Object, ObjectKey
from kvpool_agent.l2.codec import ObjectCodec
from kvpool_agent.l2.keyring import Keyring, generate_key
from kvpool_agent.l2.nvme import BLOCK, NvmeAdapter
from kvpool_agent.l2.s3 import S3Adapter
from kvpool_agent.testing.s3_server import moto_server

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

TENANT = tenant_id("bench")
MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-mib", default="2,32", help="chunk sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (best is shown)")
    parser.add_argument("--group-mib", type=int, default=128, help="MiB per turn of a side")
    parser.add_argument("--concurrency", type=int, default=16, help="threads / max_concurrency")
    parser.add_argument("--skip-nvme", action="store_true", help="no NVMe benchmark")
    parser.add_argument("--skip-s3", action="store_true", help="no S3 benchmark")
    parser.add_argument(
        "--nvme-dir", type=Path, help="directory on the device to test (default: a temp dir)"
    )
    parser.add_argument("--nvme-mib", type=int, default=1024, help="NVMe working set, MiB")
    parser.add_argument("--fsync", choices=["never", "data", "always"], default="data")
    parser.add_argument("--direct-io", action="store_true", help="O_DIRECT on both sides")
    parser.add_argument("--s3-mib", type=int, default=256, help="S3 working set, MiB")
    parser.add_argument("--s3-endpoint", help="an S3 endpoint (default: a local moto server)")
    parser.add_argument("--s3-bucket", help="an existing bucket at --s3-endpoint")


def run(args: argparse.Namespace) -> None:
    sizes = [int(mib) * MiB for mib in args.chunk_mib.split(",")]
    if not args.skip_nvme:
        print(asyncio.run(nvme_report(args, sizes)))
        print()
    if not args.skip_s3 and args.s3_endpoint:
        print(asyncio.run(s3_report(args, sizes, args.s3_endpoint)))
    elif not args.skip_s3:
        for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # moto takes any
            os.environ.setdefault(variable, "kvpool-bench")
        with moto_server() as endpoint:
            print(asyncio.run(s3_report(args, sizes, endpoint)))


@dataclass(frozen=True)
class _Workload:
    size: int
    names: list[ObjectKey]
    payloads: list[bytes]
    groups: list[range]
    """Indices of the chunks of each turn."""

    @property
    def nbytes(self) -> int:
        return self.size * len(self.payloads)


def _workload(size: int, total: int, group_bytes: int) -> _Workload:
    count, per_group = max(1, total // size), max(1, group_bytes // size)
    block = os.urandom(size)  # distinct chunks, cheap to make: rotations of one random block
    return _Workload(
        size,
        [ObjectKey(TENANT, hashlib.sha256(b"%d-%d" % (size, i)).digest()) for i in range(count)],
        [block[i % size :] + block[: i % size] for i in range(count)],
        [range(first, min(first + per_group, count)) for first in range(0, count, per_group)],
    )


def _codec(keys: Path, *, seal: bool) -> ObjectCodec:
    """A codec under a key generated in ``keys`` (read once: the keys are not reread)."""
    generate_key(keys)
    return ObjectCodec(Keyring(keys, reload_seconds=math.inf), "bench", seal=seal)


class _Side(Protocol):
    """One side of a comparison: writes and reads a workload, a group at a time."""

    async def write(self, group: range) -> None: ...

    def before_reads(self) -> None:
        """Untimed: what makes the reads honest (drop the page cache)."""

    async def read(self, group: range) -> None:
        """Read a group back and check its bytes."""

    async def clean(self) -> None: ...


async def _compare(repeats: int, work: _Workload, sides: list[_Side]) -> list[list[float]]:
    """Best [write, read] seconds of each side; the first side is the baseline.

    The first run is a warm-up, not counted: on a thin-provisioned virtual disk the
    first write to a block costs several times the next one.
    """
    best = [[float("inf")] * 2 for _ in sides]
    for repeat in range(repeats + 1):
        spent = [[0.0] * 2 for _ in sides]
        for phase in (0, 1):  # writes, then reads
            if phase:
                for side in sides:
                    side.before_reads()
            for number, group in enumerate(work.groups):
                turn = (number + repeat) % len(sides)  # who goes first rotates
                for index in [*range(turn, len(sides)), *range(turn)]:
                    started = time.perf_counter()
                    await (sides[index].read(group) if phase else sides[index].write(group))
                    spent[index][phase] += time.perf_counter() - started
        for side in sides:
            await side.clean()
        if repeat:
            for old, new in zip(best, spent, strict=True):
                old[:] = [min(pair) for pair in zip(old, new, strict=True)]
    return best


def _rows(
    work: _Workload, operations: tuple[str, str], best: list[list[float]], goal: str
) -> list[list[str]]:
    """Rows of the second side (the adapter) against the first (raw)."""
    return [
        [
            f"{work.size // MiB} MiB",
            operation,
            f"{work.nbytes / raw / 1e9:.2f} GB/s",
            f"{work.nbytes / ours / 1e9:.2f} GB/s",
            f"{raw / ours:.2f}",
            goal,
        ]
        for operation, raw, ours in zip(operations, best[0], best[1], strict=True)
    ]


class _AdapterSide:
    def __init__(self, adapter: NvmeAdapter | S3Adapter, work: _Workload) -> None:
        self.adapter, self.work = adapter, work

    async def write(self, group: range) -> None:
        work = self.work
        _all(await self.adapter.put([L2Object(work.names[i], work.payloads[i]) for i in group]))

    def before_reads(self) -> None:
        if isinstance(self.adapter, NvmeAdapter):
            drop_page_cache([self.adapter.path_of(name) for name in self.work.names])

    async def read(self, group: range) -> None:
        got = await self.adapter.get([self.work.names[i] for i in group])
        _same(got, [self.work.payloads[i] for i in group])

    async def clean(self) -> None:
        _all(await self.adapter.delete(self.work.names))


def _all(results: list[bool]) -> None:
    if not all(results):
        raise AssertionError("an operation failed")


def _same(got: list[bytes] | list[bytes | None], payloads: list[bytes]) -> None:
    if got != payloads:
        raise AssertionError("a read returned other bytes")


# NVMe


async def nvme_report(args: argparse.Namespace, sizes: list[int]) -> str:
    rows = []
    with (
        tempfile.TemporaryDirectory(dir=args.nvme_dir, prefix="kvpool-bench-l2-") as tmp,
        ThreadPoolExecutor(args.concurrency) as pool,
    ):
        root = Path(tmp)
        config = NvmeTierConfig(
            path=root / "adapter",
            capacity=2 * args.nvme_mib * MiB,
            fsync=args.fsync,
            direct_io=args.direct_io,
            max_concurrency=args.concurrency,
        )
        codec = _codec(root / "keys", seal=config.encryption)
        adapter = NvmeAdapter(config, "bench", lambda tenant: None, codec)
        if args.direct_io and not adapter.direct_io:
            raise SystemExit(f"{root} refuses O_DIRECT")
        (root / "raw").mkdir()
        for size in sizes:
            work = _workload(size, args.nvme_mib * MiB, args.group_mib * MiB)
            raw = _RawFiles(root / "raw", work, pool, args.fsync, args.direct_io)
            ours = _AdapterSide(adapter, work)
            best = await _compare(args.repeats, work, [raw, ours])
            rows += _rows(work, ("write", "read"), best, ">= 0.9")
        await adapter.close()
    mode = "O_DIRECT" if args.direct_io else "buffered, page cache dropped before reads"
    return table(
        f"NVMe adapter vs raw files: {args.nvme_mib} MiB per size, fsync={args.fsync}, {mode}, "
        f"{args.concurrency} threads",
        ["chunk", "op", "raw files", "adapter", "ratio", "goal"],
        rows,
    )


class _RawFiles:
    """The baseline: one plain file per chunk, written in place and read whole."""

    def __init__(
        self,
        directory: Path,
        work: _Workload,
        pool: ThreadPoolExecutor,
        fsync: str,
        direct_io: bool,
    ) -> None:
        self.work, self.pool, self.fsync = work, pool, fsync
        # The adapter's directory layout, so that the ratio measures the rest of it.
        self.paths = [directory / layout.relative_path(name) for name in work.names]
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.direct = os.O_DIRECT if direct_io else 0

    async def write(self, group: range) -> None:
        list(self.pool.map(self._write, group))

    def before_reads(self) -> None:
        drop_page_cache(self.paths)

    async def read(self, group: range) -> None:
        _same(list(self.pool.map(self._read, group)), [self.work.payloads[i] for i in group])

    async def clean(self) -> None:
        for path in self.paths:
            path.unlink()

    def _write(self, index: int) -> None:
        path, data = self.paths[index], self.work.payloads[index]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self.direct, 0o640)
        try:
            buffer: bytes | mmap.mmap = data
            if self.direct:  # an aligned buffer of whole blocks, as O_DIRECT requires
                buffer = mmap.mmap(-1, -(-len(data) // BLOCK) * BLOCK)
                buffer[: len(data)] = data
            with memoryview(buffer) as view:
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            if self.fsync != "never":
                os.fdatasync(fd)
        finally:
            os.close(fd)
        if self.fsync == "always":
            directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(directory)
            os.close(directory)

    def _read(self, index: int) -> bytes:
        if not self.direct:
            with open(self.paths[index], "rb", buffering=0) as file:
                return file.readall()
        fd = os.open(self.paths[index], os.O_RDONLY | os.O_DIRECT)
        try:
            size = os.fstat(fd).st_size
            buffer = mmap.mmap(-1, -(-size // BLOCK) * BLOCK)
            with memoryview(buffer) as view:
                done = 0
                while done < size:
                    done += os.preadv(fd, [view[done:]], done)
                return bytes(view[:size])
        finally:
            os.close(fd)


def drop_page_cache(paths: list[Path]) -> None:
    """Make reads of ``paths`` come from the device (our own files: no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# S3


async def s3_report(args: argparse.Namespace, sizes: list[int], endpoint: str) -> str:
    bucket = args.s3_bucket or f"kvpool-bench-{uuid.uuid4().hex[:12]}"
    config = S3TierConfig(bucket=bucket, endpoint_url=endpoint, max_concurrency=args.concurrency)
    part = int(config.part_size)
    # One request per object, as the raw calls; and the default: parallel parts.
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-l2-keys-") as keys:
        codec = _codec(Path(keys), seal=config.encryption)
    whole = S3Adapter(config.model_copy(update={"multipart_threshold": 5 << 30}), "bench", codec)
    parts = S3Adapter(config, "bench", codec)
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name=config.region,
        config=Config(  # the adapter's client settings
            connect_timeout=config.connect_timeout_seconds,
            read_timeout=config.read_timeout_seconds,
            retries={"max_attempts": config.max_attempts, "mode": "standard"},
            max_pool_connections=args.concurrency,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )
    if not args.s3_bucket:
        client.create_bucket(Bucket=bucket)
    rows = []
    with ThreadPoolExecutor(args.concurrency) as pool:
        for size in sizes:
            work = _workload(size, args.s3_mib * MiB, args.group_mib * MiB)
            sides: list[_Side] = [_RawBoto3(client, bucket, work, pool), _AdapterSide(whole, work)]
            if size >= int(config.multipart_threshold):
                sides.append(_AdapterSide(parts, work))
            best = await _compare(args.repeats, work, sides)
            rows += _rows(work, ("put", "get"), best[:2], ">= 0.8")
            if len(best) == 3:
                labels = (f"put, {part // MiB} MiB parts", f"get, {part // MiB} MiB ranges")
                rows += _rows(work, labels, [best[0], best[2]], "")
    await whole.close()
    await parts.close()
    client.close()
    return table(
        f"S3 adapter vs raw boto3 at {endpoint}: {args.s3_mib} MiB per size, "
        f"{args.concurrency} threads",
        ["chunk", "op", "raw boto3", "adapter", "ratio", "goal"],
        rows,
    )


class _RawBoto3:
    """The baseline: put_object and get_object of each chunk, one request each."""

    def __init__(
        self, client: S3Client, bucket: str, work: _Workload, pool: ThreadPoolExecutor
    ) -> None:
        self.client, self.bucket, self.work, self.pool = client, bucket, work, pool
        self.keys = [f"bench-raw/{work.size}/{i}" for i in range(len(work.payloads))]

    async def write(self, group: range) -> None:
        list(self.pool.map(self._put, group))

    def before_reads(self) -> None:
        """Nothing to drop."""

    async def read(self, group: range) -> None:
        _same(list(self.pool.map(self._get, group)), [self.work.payloads[i] for i in group])

    async def clean(self) -> None:
        for key in self.keys:
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def _put(self, index: int) -> None:
        self.client.put_object(
            Bucket=self.bucket, Key=self.keys[index], Body=self.work.payloads[index]
        )

    def _get(self, index: int) -> bytes:
        response = self.client.get_object(Bucket=self.bucket, Key=self.keys[index])
        return response["Body"].read()
