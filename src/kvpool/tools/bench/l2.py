"""``kvpool bench l2``: the L2 adapters against the raw I/O they wrap, sealed against
plaintext, and the codec's own speed, in the same run.

Codec: :class:`ObjectCodec` ``encode`` and ``open`` of ``--codec-mib`` of chunks
on one core, sealing (AES-256-GCM) and not (GMAC over the plaintext): the
ceiling of each side's cryptography, for reading the tier figures against. Each
output is dropped when made, as the adapters drop a body once written, so the
allocator's cost is in the figure too: where glibc maps an output afresh (large
ones), its page faults, which can cost more than the AES.

NVMe: the adapter's put and get of ``--nvme-mib`` of chunks against plain file
writes and reads of the same bytes: same chunk sizes, fsync setting, threads
(``--concurrency``) and filesystem (``--nvme-dir``); with ``--direct-io`` all
sides use O_DIRECT. Before the reads every file is synced and dropped from the
page cache (``posix_fadvise(DONTNEED)``), so every side reads from the device.
The adapter runs twice, as a sealing and as a plaintext tier (its default).
Goals: the default adapter >= 0.9 of raw; sealed >= 0.8 of plaintext for
chunks from 1 MiB.

S3: the adapter's put and get against raw boto3 ``put_object``/``get_object``
with the same client settings and threads, against the same endpoint: a moto
server started here on 127.0.0.1 (in its own process), or ``--s3-endpoint`` and
``--s3-bucket``. The adapter is measured as the raw calls work, one request per
object, sealing (its default; goal: >= 0.8 of raw) and plaintext (goal: sealed
>= 0.8 of plaintext for chunks from 1 MiB), and for chunks from the default
``multipart_threshold`` also with its default parallel parts and ranges (for
information: they pay off against S3's per-connection limits, while moto
re-reads a whole object for every range).

Every figure comes with the CPU it cost: this process's CPU seconds (user and
system, every thread) during a side's turns per GB moved; a local moto server's
CPU is not in it.

Shared disks and servers drift by several times within seconds, so the sides
take turns in groups of ``--group-mib`` (the side that goes first rotates),
each side's time is summed over the groups, and each figure is the best of
``--repeats`` such runs after an untimed warm-up run (its CPU the least of
them). Every read is checked against what was written.
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import boto3
import numpy
from botocore.config import Config

from kvpool.agent.l2 import layout
from kvpool.agent.l2.base import L2Object, ObjectKey
from kvpool.agent.l2.buffers import BufferPool
from kvpool.agent.l2.codec import ObjectCodec
from kvpool.agent.l2.nvme import NvmeAdapter
from kvpool.agent.l2.nvme_files import BLOCK
from kvpool.agent.l2.s3 import S3Adapter
from kvpool.common import problems
from kvpool.common.config import NvmeTierConfig, S3TierConfig
from kvpool.common.keyring import Keyring, generate_key
from kvpool.common.keys import tenant_id
from kvpool.tools.bench.local.s3_server import moto_server
from kvpool.tools.bench.report import add_chunk_mib, chunk_bytes, chunk_label, goal, table

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

TENANT = tenant_id("bench")
MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_chunk_mib(parser)
    parser.add_argument(
        "--repeats", type=problems.number(int), default=3, help="runs per figure (best is shown)"
    )
    parser.add_argument(
        "--group-mib", type=problems.number(int), default=128, help="MiB per turn of a side"
    )
    parser.add_argument(
        "--concurrency", type=problems.number(int), default=16, help="threads / max_concurrency"
    )
    parser.add_argument(
        "--codec-mib", type=problems.number(int), default=256, help="codec working set, MiB"
    )
    parser.add_argument("--skip-codec", action="store_true", help="no codec benchmark")
    parser.add_argument("--skip-nvme", action="store_true", help="no NVMe benchmark")
    parser.add_argument("--skip-s3", action="store_true", help="no S3 benchmark")
    parser.add_argument(
        "--nvme-dir", type=Path, help="directory on the device to test (default: a temp dir)"
    )
    parser.add_argument(
        "--nvme-mib", type=problems.number(int), default=1024, help="NVMe working set, MiB"
    )
    parser.add_argument("--fsync", choices=["never", "data", "always"], default="data")
    parser.add_argument("--direct-io", action="store_true", help="O_DIRECT on both sides")
    parser.add_argument(
        "--s3-mib", type=problems.number(int), default=256, help="S3 working set, MiB"
    )
    parser.add_argument("--s3-endpoint", help="an S3 endpoint (default: a local moto server)")
    parser.add_argument("--s3-bucket", help="an existing bucket at --s3-endpoint")


def run(args: argparse.Namespace) -> None:
    sizes = [chunk_bytes(mib) for mib in args.chunk_mib]
    if not args.skip_codec:
        print(asyncio.run(codec_report(args, sizes)))
        print()
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
    keyring = Keyring(keys, reload_seconds=math.inf)
    return ObjectCodec(keyring, "bench", seal=seal, buffers=BufferPool())


class _Side(Protocol):
    """One side of a comparison: writes and reads a workload, a group at a time."""

    async def write(self, group: range) -> None: ...

    def before_reads(self) -> None:
        """Untimed: what makes the reads honest (drop the page cache)."""

    async def read(self, group: range) -> None:
        """Read a group back and check its bytes."""

    async def clean(self) -> None: ...


@dataclass(frozen=True)
class _Cost:
    """A side's [write, read] seconds, and this process's CPU seconds meanwhile."""

    seconds: list[float]
    cpu: list[float]


async def _compare(repeats: int, work: _Workload, sides: list[_Side]) -> list[_Cost]:
    """Each side's best seconds and least CPU seconds of ``repeats`` runs.

    The first run is a warm-up, not counted: on a thin-provisioned virtual disk the
    first write to a block costs several times the next one.
    """
    best = [_Cost([math.inf] * 2, [math.inf] * 2) for _ in sides]
    for repeat in range(repeats + 1):
        spent = [_Cost([0.0] * 2, [0.0] * 2) for _ in sides]
        for phase in (0, 1):  # writes, then reads
            if phase:
                for side in sides:
                    side.before_reads()
            for number, group in enumerate(work.groups):
                turn = (number + repeat) % len(sides)  # who goes first rotates
                for index in [*range(turn, len(sides)), *range(turn)]:
                    started, cpu = time.perf_counter(), time.process_time()
                    await (sides[index].read(group) if phase else sides[index].write(group))
                    spent[index].seconds[phase] += time.perf_counter() - started
                    spent[index].cpu[phase] += time.process_time() - cpu
        for side in sides:
            await side.clean()
        if repeat:
            for old, new in zip(best, spent, strict=True):
                old.seconds[:] = map(min, old.seconds, new.seconds)
                old.cpu[:] = map(min, old.cpu, new.cpu)
    return best


def _columns(base: str, other: str) -> list[str]:
    return ["chunk", "op", base, other, "ratio", "goal", f"{base} CPU s/GB", f"{other} CPU s/GB"]


def _rows(
    work: _Workload, operations: tuple[str, str], base: _Cost, other: _Cost, bound: float | None
) -> list[list[str]]:
    """Rows of ``other`` against ``base``: throughput, its ratio (and its goal, ``bound``,
    marked where missed), CPU per GB of each."""
    gigabytes = work.nbytes / 1e9
    return [
        [
            chunk_label(work.size),
            operation,
            f"{gigabytes / base_seconds:.2f} GB/s",
            f"{gigabytes / other_seconds:.2f} GB/s",
            f"{base_seconds / other_seconds:.2f}",
            ""
            if bound is None
            else goal(f">= {bound}", base_seconds / other_seconds, bound, at_least=True),
            f"{base_cpu / gigabytes:.3f}",
            f"{other_cpu / gigabytes:.3f}",
        ]
        for operation, base_seconds, other_seconds, base_cpu, other_cpu in zip(
            operations, base.seconds, other.seconds, base.cpu, other.cpu, strict=True
        )
    ]


def _sealing_goal(work: _Workload) -> float | None:
    return 0.8 if work.size >= MiB else None


def _mode(seal: bool) -> str:
    return "sealed" if seal else "plaintext"


def _default_side(config: NvmeTierConfig | S3TierConfig) -> int:
    """Which of [raw, plaintext adapter, sealed adapter] is the tier as configured by default."""
    return 2 if config.encryption else 1


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


def _same(got: Sequence[bytes | memoryview | None], payloads: list[bytes]) -> None:
    """Every read against what was written, at one cost whatever the buffer's type (Python
    compares a memoryview byte by byte, 30 times slower than bytes)."""
    if len(got) != len(payloads) or not all(
        one is not None and numpy.array_equal(_bytes_of(one), _bytes_of(payload))
        for one, payload in zip(got, payloads, strict=True)
    ):
        raise AssertionError("a read returned other bytes")


def _bytes_of(buffer: bytes | memoryview) -> numpy.ndarray[tuple[int], numpy.dtype[numpy.uint8]]:
    return numpy.frombuffer(buffer, numpy.uint8)


# Codec


async def codec_report(args: argparse.Namespace, sizes: list[int]) -> str:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-l2-keys-") as keys:
        plain, sealed = (_codec(Path(keys), seal=seal) for seal in (False, True))
    for size in sizes:
        work = _workload(size, args.codec_mib * MiB, args.group_mib * MiB)
        sides: list[_Side] = [_CodecSide(plain, work), _CodecSide(sealed, work)]
        best = await _compare(args.repeats, work, sides)
        rows += _rows(work, ("encode", "open"), best[0], best[1], None)
    return table(
        f"ObjectCodec on one core, the ceiling of each side's cryptography: "
        f"{args.codec_mib} MiB per size",
        _columns("plaintext (GMAC)", "sealed (AES-GCM)"),
        rows,
    )


class _CodecSide:
    """The codec alone, on this thread: encode as the write, open as the read.

    Each output is dropped as soon as it is made, as the adapters drop a body once it
    is written, so that the figure is the codec's in a steady state (allocator included).
    """

    def __init__(self, codec: ObjectCodec, work: _Workload) -> None:
        self.codec, self.work = codec, work
        self.encoded: list[tuple[bytes, bytes]] = []

    async def write(self, group: range) -> None:
        for i in group:
            with self.codec.encode(self.work.names[i], self.work.payloads[i]):
                pass

    def before_reads(self) -> None:
        """Untimed: the objects to open, each opened and checked once here."""
        names, payloads = self.work.names, self.work.payloads
        for name, payload in zip(names, payloads, strict=True):
            with self.codec.encode(name, payload) as (header, body):
                self.encoded.append((header, bytes(body)))
        opened = [self.codec.open(n, *pair) for n, pair in zip(names, self.encoded, strict=True)]
        _same(opened, payloads)

    async def read(self, group: range) -> None:
        for i in group:
            self.codec.open(self.work.names[i], *self.encoded[i])

    async def clean(self) -> None:
        self.encoded.clear()


# NVMe


async def nvme_report(args: argparse.Namespace, sizes: list[int]) -> str:
    against_raw, sealing = [], []
    with (
        tempfile.TemporaryDirectory(dir=args.nvme_dir, prefix="kvpool-bench-l2-") as tmp,
        ThreadPoolExecutor(args.concurrency) as pool,
    ):
        root = Path(tmp)
        config = NvmeTierConfig(
            path=root,
            capacity=2 * args.nvme_mib * MiB,
            fsync=args.fsync,
            direct_io=args.direct_io,
            max_concurrency=args.concurrency,
        )
        adapters = [  # plaintext, sealed: in directories of their own
            NvmeAdapter(
                config.model_copy(update={"path": root / _mode(seal), "encryption": seal}),
                "bench",
                lambda tenant: None,
                _codec(root / "keys", seal=seal),
            )
            for seal in (False, True)
        ]
        if args.direct_io and not all(adapter.direct_io for adapter in adapters):
            raise SystemExit(f"{root} refuses O_DIRECT")
        (root / "raw").mkdir()
        for size in sizes:
            work = _workload(size, args.nvme_mib * MiB, args.group_mib * MiB)
            raw = _RawFiles(root / "raw", work, pool, args.fsync, args.direct_io)
            sides: list[_Side] = [raw, *(_AdapterSide(adapter, work) for adapter in adapters)]
            best = await _compare(args.repeats, work, sides)
            against_raw += _rows(work, ("write", "read"), best[0], best[_default_side(config)], 0.9)
            sealing += _rows(work, ("write", "read"), best[1], best[2], _sealing_goal(work))
        for adapter in adapters:
            await adapter.close()
    mode = "O_DIRECT" if args.direct_io else "buffered, page cache dropped before reads"
    setting = (
        f"{args.nvme_mib} MiB per size, fsync={args.fsync}, {mode}, {args.concurrency} threads"
    )
    return "\n\n".join(
        [
            table(
                f"NVMe adapter ({_mode(config.encryption)}, its default) vs raw files: {setting}",
                _columns("raw files", "adapter"),
                against_raw,
            ),
            table(
                f"NVMe adapter sealed (AES-GCM) vs plaintext (GMAC), same run: {setting}",
                _columns("plaintext", "sealed"),
                sealing,
            ),
        ]
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
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-l2-keys-") as keys:
        codecs = {seal: _codec(Path(keys), seal=seal) for seal in (False, True)}
    # One request per object, as the raw calls, plaintext and sealed under prefixes of their
    # own; and the default: parallel parts.
    whole = [
        S3Adapter(
            config.model_copy(
                update={
                    "multipart_threshold": 5 << 30,
                    "prefix": f"bench-{_mode(seal)}",
                    "encryption": seal,
                }
            ),
            "bench",
            codecs[seal],
        )
        for seal in (False, True)
    ]
    parts = S3Adapter(config, "bench", codecs[config.encryption])
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
    against_raw, sealing = [], []
    with ThreadPoolExecutor(args.concurrency) as pool:
        for size in sizes:
            work = _workload(size, args.s3_mib * MiB, args.group_mib * MiB)
            sides: list[_Side] = [
                _RawBoto3(client, bucket, work, pool),
                *(_AdapterSide(adapter, work) for adapter in whole),
            ]
            if size >= int(config.multipart_threshold):
                sides.append(_AdapterSide(parts, work))
            best = await _compare(args.repeats, work, sides)
            against_raw += _rows(work, ("put", "get"), best[0], best[_default_side(config)], 0.8)
            if len(best) == 4:
                labels = (f"put, {part // MiB} MiB parts", f"get, {part // MiB} MiB ranges")
                against_raw += _rows(work, labels, best[0], best[3], None)
            sealing += _rows(work, ("put", "get"), best[1], best[2], _sealing_goal(work))
    for adapter in [*whole, parts]:
        await adapter.close()
    client.close()
    setting = f"{args.s3_mib} MiB per size, {args.concurrency} threads"
    return "\n\n".join(
        [
            table(
                f"S3 adapter ({_mode(config.encryption)}, its default) vs raw boto3 at "
                f"{endpoint}: {setting}",
                _columns("raw boto3", "adapter"),
                against_raw,
            ),
            table(
                f"S3 adapter sealed (AES-GCM) vs plaintext (GMAC), one request per object, "
                f"same run: {setting}",
                _columns("plaintext", "sealed"),
                sealing,
            ),
        ]
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
