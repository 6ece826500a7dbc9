"""The ``kvpool bench service`` workload, run against LMCache's multiprocess server.

This file is a standalone script for the interpreter of a separate virtual
environment that holds ``lmcache==0.5.6``; it is never imported by
``kvpool`` (it imports nothing from it, and only the standard library at
module level)::

    python3 -m venv ../lmcache-venv          # beside the checkout, outside the repository
    ../lmcache-venv/bin/pip install torch==2.13.0   # the local CPU build
    ../lmcache-venv/bin/pip install lmcache==0.5.6
    ../lmcache-venv/bin/python benchmarks/lmcache_peer.py \\
        [--working-set-mib 256] [--chunk-sizes 262144,2097152,33554432] \\
        [--clients 1,4] [--lookups 2000] [--path shm|zmq] \\
        [--no-prefault] [--cold-client-map] [--timeout 280]

It starts ``lmcache server`` (the MP server with its HTTP frontend, as deployed
next to vLLM) on 127.0.0.1 with the engine-driven transfer mode, then drives it
the way a CPU vLLM worker's engine-driven path does (``EngineDrivenTransferContext``
less its gather from paged KV blocks: chunks here are contiguous, as in kvpool's
bench), through LMCache's own client classes: ``RequestClientFactory`` (ZMQ
DEALER client), the
``REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT`` RPC and the ``EngineDrivenContext``
returned by ``create_engine_driven_context`` (``EngineDrivenContextShm`` over the
server's L1 pool in /dev/shm, or ``EngineDrivenContextPickle`` over ZMQ with
``--path zmq``). Stores are PREPARE_STORE, a copy into the returned slots and
COMMIT_STORE; retrieves are LOOKUP, WAIT_PREFETCH_STATUS (the hit count, which
read-locks the chunks), PREPARE_RETRIEVE, a copy out of the slots and
COMMIT_RETRIEVE (which releases the locks).

It prints one JSON object on stdout (the server's and LMCache's logs go to
stderr and to a temporary file): store and retrieve throughput for each chunk
size and client count, against a raw memcpy of the same bytes in the same
client processes, and the round trip of a lookup of a 64-chunk cached prefix.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import json
import mmap
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import multiprocessing.queues
import os
import random
import signal
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from multiprocessing.synchronize import Barrier
from types import FrameType
from typing import Any

from lmcache_server import CHUNK_TOKENS, NO_TRACKING, RPC_TIMEOUT, LMCacheServer, lmcache_client

BATCH_BYTES = 64 << 20  # bytes per PREPARE/COMMIT request, as in ``kvpool bench service``
LOOKUP_CHUNKS = 64
LOOKUP_CHUNK_BYTES = 4096
LOOKUP_WARMUP = 200
BLOCK_SIZE = 16  # vLLM's default block size; metadata only on this path
KV_DTYPE = "bfloat16"
DTYPE_BYTES = 2
BARRIER_TIMEOUT = 180.0
MADV_POPULATE_READ = 22  # Linux 5.14
MADV_POPULATE_WRITE = 23
EVICTION_WATERMARK = 0.8  # LMCache's default --eviction-trigger-watermark


class BenchTimeout(Exception):
    """The whole run went past ``--timeout``."""


@dataclass(frozen=True)
class Layout:
    """One KV chunk as LMCache's engine-driven path sees it: [2, layers, tokens, hidden]."""

    num_layers: int
    hidden: int
    tokens: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_layers, self.tokens, self.hidden)

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * self.tokens * self.hidden * DTYPE_BYTES


def layout_for(chunk_bytes: int, tokens: int = CHUNK_TOKENS) -> Layout:
    """A plausible model shape whose 256-token chunk is ``chunk_bytes`` of bf16 K and V."""
    per_token_bytes = 2 * tokens * DTYPE_BYTES
    if chunk_bytes % per_token_bytes:
        raise ValueError(f"chunk size {chunk_bytes} is not a multiple of {per_token_bytes}")
    per_token = chunk_bytes // per_token_bytes  # layers * hidden
    for layers in (32, 16, 8, 4, 2, 1):
        if per_token % layers == 0 and per_token // layers >= min(256, per_token):
            layout = Layout(layers, per_token // layers, tokens)
            assert layout.nbytes == chunk_bytes
            return layout
    raise AssertionError("unreachable: one layer always fits")


@dataclass(frozen=True)
class ClientSpec:
    endpoint: str
    worker: int
    chunk_bytes: int
    working_set: int
    model_name: str
    path: str
    populate: bool


@dataclass(frozen=True)
class Phase:
    store_seconds: float
    retrieve_seconds: float
    memcpy_seconds: float
    mismatches: int
    context_class: str
    error: str = ""


# ---------------------------------------------------------------- LMCache client side


def _register(req_client: Any, instance_id: int, model_name: str, layout: Layout, path: str) -> Any:
    """Register a CPU worker's KV layout; return LMCache's engine-driven transfer context."""
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc  # type: ignore[import-not-found, unused-ignore]
    from lmcache.v1.multiprocess.custom_types import (  # type: ignore[import-not-found, unused-ignore]
        RegisterEngineDrivenContextPayload,
    )
    from lmcache.v1.multiprocess.transfer_context import (  # type: ignore[import-not-found, unused-ignore]
        EngineDrivenContextMetadata,
        create_engine_driven_context,
    )

    response = req_client.register_kv_cache_engine_driven_context(
        RegisterEngineDrivenContextPayload(
            instance_id=instance_id,
            model_name=model_name,
            world_size=1,
            block_size=BLOCK_SIZE,
            num_layers=layout.num_layers,
            hidden_dim_size=layout.hidden,
            dtype_str=KV_DTYPE,
            use_mla=False,
            num_physical_slots=layout.tokens,
        )
    ).result(timeout=RPC_TIMEOUT)
    metadata = EngineDrivenContextMetadata(
        layout_desc=MemoryLayoutDesc(
            shapes=[torch.Size(layout.shape)], dtypes=[getattr(torch, KV_DTYPE)]
        ),
        block_size=BLOCK_SIZE,
        use_mla=False,
    )
    return create_engine_driven_context(
        metadata,
        req_client,
        RPC_TIMEOUT,
        shm_name=response.shm_name,
        pool_size=response.pool_size,
        use_pickle=path == "zmq",
    )


def _key(model_name: str, tokens: tuple[int, ...], request_id: str) -> Any:
    """The cache key a worker sends: the request's token ids and the range it covers."""
    from lmcache.v1.multiprocess.custom_types import (  # type: ignore[import-not-found, unused-ignore]
        IPCCacheServerKey,
    )

    return IPCCacheServerKey(
        model_name=model_name,
        world_size=1,
        worker_id=0,
        token_ids=tokens,
        start=0,
        end=len(tokens),
        request_id=request_id,
        num_kv_readers=1,
    )


def _store(context: Any, key: Any, instance_id: int, chunks: list[Any]) -> None:
    """PREPARE_STORE, copy each chunk in, COMMIT_STORE (pickle path: the chunks ride along)."""
    prepared = context.prepare_store(key, instance_id)
    if prepared is None:  # pickle over ZMQ: the engine gathers into fresh CPU tensors
        payload = [chunk.clone() for chunk in chunks]
    else:
        slots, indices = prepared
        if not indices:
            return  # all already cached
        for slot, index in zip(slots, indices, strict=True):
            slot.copy_(chunks[index])
        payload = slots
    if not context.commit_store(key, instance_id, payload):
        raise RuntimeError("COMMIT_STORE failed")


def _lookup(req_client: Any, key: Any) -> int:
    """LOOKUP then WAIT_PREFETCH_STATUS: the number of cached prefix chunks, read-locked."""
    lookup_key = key.no_worker_id_version()
    req_client.lookup(lookup_key, 1).result(timeout=RPC_TIMEOUT)
    hits = req_client.wait_prefetch_status(key.request_id, RPC_TIMEOUT).result(
        timeout=RPC_TIMEOUT + 5
    )
    return int(hits or 0)


def _retrieve(req_client: Any, context: Any, key: Any, instance_id: int, out: list[Any]) -> None:
    """Lookup (locks), PREPARE_RETRIEVE, copy each chunk out, COMMIT_RETRIEVE (unlocks)."""
    hits = _lookup(req_client, key)
    if hits != len(out):
        raise RuntimeError(f"lookup hit {hits} of {len(out)} chunks")
    chunks = context.prepare_retrieve(key, instance_id)
    if chunks is None or len(chunks) != len(out):
        raise RuntimeError("PREPARE_RETRIEVE missed")
    for target, chunk in zip(out, chunks, strict=True):
        target.copy_(chunk)
    context.commit_retrieve(key, instance_id)


def _populate_client_map(context: Any) -> bool:
    """Fault the pool into this worker's mapping of it (page tables only, data untouched).

    A long-running vLLM worker has touched the whole pool after a while; a fresh
    benchmark process has not, and would pay a page fault per 4 KiB in its
    first copies. kvpool's client maps its segment with MAP_POPULATE before the
    timed phases for the same reason. Returns False on the pickle path.
    """
    buffer = getattr(context, "_shm_buffer", None)  # EngineDrivenContextShm's mapping
    if buffer is None:
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for advice in (MADV_POPULATE_WRITE, MADV_POPULATE_READ):
        if libc.madvise(address, len(buffer), advice) == 0:
            return True
    # Older kernels: read one byte of every page.
    import torch

    torch.frombuffer(buffer, dtype=torch.uint8)[:: mmap.PAGESIZE].sum()
    return True


def _private_buffer(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)


def _memcpy_chunks(source: mmap.mmap, target: mmap.mmap, step: int) -> None:
    """The raw memcpy of the same bytes, chunk by chunk like the workload.

    One huge memcpy would take glibc's non-temporal path, which is not what either
    system does for its chunks.
    """
    with memoryview(source) as src, memoryview(target) as dst:
        for start in range(0, len(dst), step):
            dst[start : start + step] = src[start : start + step]


def _client(spec: ClientSpec, barrier: Barrier) -> Phase:
    import torch

    torch.set_num_threads(1)  # a plain single-threaded copy, like a memcpy
    layout = layout_for(spec.chunk_bytes)
    count = spec.working_set // spec.chunk_bytes
    size = count * spec.chunk_bytes
    source, target = _private_buffer(size), _private_buffer(size)
    block = os.urandom(1 << 20)
    for offset in range(0, size, len(block)):
        source[offset : offset + len(block)] = block[: size - offset]
    source_bytes = torch.frombuffer(source, dtype=torch.uint8)
    target_bytes = torch.frombuffer(target, dtype=torch.uint8)
    dtype = getattr(torch, KV_DTYPE)
    source_chunks = list(source_bytes.view(dtype).view(count, *layout.shape).unbind(0))
    target_chunks = list(target_bytes.view(dtype).view(count, *layout.shape).unbind(0))
    per_batch = max(1, BATCH_BYTES // spec.chunk_bytes)
    batches = [list(range(i, min(i + per_batch, count))) for i in range(0, count, per_batch)]
    rng = random.Random(f"{spec.model_name}/{spec.worker}")
    tokens = [
        tuple(rng.randrange(1, 1 << 17) for _ in range(len(batch) * layout.tokens))
        for batch in batches
    ]
    tag = uuid.uuid4().hex[:8]
    instance_id = 1000 + spec.worker
    req_client, zmq_context = lmcache_client(spec.endpoint)
    context = _register(req_client, instance_id, spec.model_name, layout, spec.path)
    try:
        if spec.populate:
            _populate_client_map(context)
        barrier.wait(BARRIER_TIMEOUT)
        started = time.perf_counter()
        _memcpy_chunks(source, target, spec.chunk_bytes)
        memcpy_seconds = time.perf_counter() - started

        barrier.wait(BARRIER_TIMEOUT)
        started = time.perf_counter()
        for b, batch in enumerate(batches):
            key = _key(spec.model_name, tokens[b], f"{tag}-store-{b}")
            _store(context, key, instance_id, [source_chunks[i] for i in batch])
        store_seconds = time.perf_counter() - started

        target_bytes.zero_()  # so that only the retrieve can make the bytes match
        barrier.wait(BARRIER_TIMEOUT)
        started = time.perf_counter()
        for b, batch in enumerate(batches):
            key = _key(spec.model_name, tokens[b], f"{tag}-load-{b}")
            _retrieve(req_client, context, key, instance_id, [target_chunks[i] for i in batch])
        retrieve_seconds = time.perf_counter() - started
        mismatches = 0 if torch.equal(source_bytes, target_bytes) else 1

        for b in range(len(batches)):
            for phase in ("store", "load"):
                req_client.end_session(f"{tag}-{phase}-{b}").result(timeout=RPC_TIMEOUT)
        return Phase(
            store_seconds, retrieve_seconds, memcpy_seconds, mismatches, type(context).__name__
        )
    finally:
        context.close()
        with contextlib.suppress(Exception):
            req_client.unregister_kv_cache_engine_driven_context(instance_id).result(
                timeout=RPC_TIMEOUT
            )
        del source_chunks, target_chunks, source_bytes, target_bytes
        req_client.close()
        zmq_context.term()


def _client_process(
    spec: ClientSpec, barrier: Barrier, results: multiprocessing.queues.Queue[dict[str, Any]]
) -> None:
    try:
        phase = _client(spec, barrier)
    except Exception as error:  # reported to the parent, which fails the run
        barrier.abort()
        phase = Phase(0.0, 0.0, 0.0, 1, "", f"{type(error).__name__}: {error}")
    results.put({"worker": spec.worker, **asdict(phase)})


def _run_clients(
    mp: multiprocessing.context.SpawnContext, template: ClientSpec, count: int, deadline: float
) -> list[Phase]:
    barrier = mp.Barrier(count)
    results: multiprocessing.queues.Queue[dict[str, Any]] = mp.Queue()
    workers = [
        mp.Process(
            target=_client_process,
            args=(replace(template, worker=w), barrier, results),
            daemon=True,
        )
        for w in range(count)
    ]
    for worker in workers:
        worker.start()
    try:
        raw = [results.get(timeout=max(1.0, deadline - time.monotonic())) for _ in workers]
    finally:
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
                worker.join(5)
    phases = [Phase(**{k: v for k, v in r.items() if k != "worker"}) for r in raw]
    errors = [p.error for p in phases if p.error]
    if errors:
        raise RuntimeError("; ".join(sorted(set(errors))))
    return phases


def _lookup_latency(endpoint: str, lookups: int, path: str) -> tuple[float, float, float]:
    """p50/p99 of LOOKUP + WAIT_PREFETCH_STATUS on a cached 64-chunk prefix, and a NOOP p50."""
    import torch

    torch.set_num_threads(1)
    layout = layout_for(LOOKUP_CHUNK_BYTES)
    model_name = "kvpool-peer-lookup"
    instance_id = 999
    req_client, zmq_context = lmcache_client(endpoint)
    context = _register(req_client, instance_id, model_name, layout, path)
    try:
        rng = random.Random(7)
        tokens = tuple(rng.randrange(1, 1 << 17) for _ in range(LOOKUP_CHUNKS * layout.tokens))
        chunks = [
            torch.full(layout.shape, float(i), dtype=getattr(torch, KV_DTYPE))
            for i in range(LOOKUP_CHUNKS)
        ]
        _store(context, _key(model_name, tokens, "lookup-store"), instance_id, chunks)
        samples = []
        for i in range(lookups + LOOKUP_WARMUP):
            key = _key(model_name, tokens, f"lookup-{i}")
            started = time.perf_counter()
            hits = _lookup(req_client, key)
            samples.append(time.perf_counter() - started)
            if hits != LOOKUP_CHUNKS:
                raise RuntimeError(f"lookup hit {hits} of {LOOKUP_CHUNKS} chunks")
            req_client.free_lookup_locks(key.no_worker_id_version(), 1).result(timeout=RPC_TIMEOUT)
            req_client.end_session(key.request_id).result(timeout=RPC_TIMEOUT)
        noops = []
        for _ in range(lookups + LOOKUP_WARMUP):
            started = time.perf_counter()
            req_client.noop().result(timeout=RPC_TIMEOUT)
            noops.append(time.perf_counter() - started)
    finally:
        context.close()
        with contextlib.suppress(Exception):
            req_client.unregister_kv_cache_engine_driven_context(instance_id).result(
                timeout=RPC_TIMEOUT
            )
        req_client.close()
        zmq_context.term()
    timed = sorted(samples[LOOKUP_WARMUP:])
    return (
        statistics.median(timed) * 1e6,
        timed[int(len(timed) * 0.99)] * 1e6,
        statistics.median(noops[LOOKUP_WARMUP:]) * 1e6,
    )


# ---------------------------------------------------------------- the server


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise BenchTimeout


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--working-set-mib", type=int, default=256, help="MiB per client")
    parser.add_argument(
        "--chunk-sizes", default=f"{256 << 10},{2 << 20},{32 << 20}", help="bytes, comma-separated"
    )
    parser.add_argument("--clients", default="1,4", help="client counts, comma-separated")
    parser.add_argument("--lookups", type=int, default=2000, help="timed lookups")
    parser.add_argument(
        "--path",
        choices=("shm", "zmq"),
        default="shm",
        help="engine-driven data path: the server's SHM pool, or pickled tensors over ZMQ",
    )
    parser.add_argument(
        "--no-prefault",
        action="store_true",
        help="leave the server's SHM pool to be faulted in by the first stores",
    )
    parser.add_argument(
        "--cold-client-map",
        action="store_true",
        help="do not fault the pool into each client's mapping before the timed phases",
    )
    parser.add_argument("--timeout", type=int, default=280, help="seconds for the whole run")
    args = parser.parse_args(argv)
    args.chunk_list = [int(size) for size in args.chunk_sizes.split(",")]
    args.client_list = [int(count) for count in args.clients.split(",")]
    args.working_set = args.working_set_mib << 20
    args.populate = args.path == "shm" and not args.cold_client_map
    for chunk in args.chunk_list:
        try:
            layout_for(chunk)
        except ValueError as error:
            parser.error(str(error))
        if args.working_set < chunk:
            parser.error(f"working set {args.working_set} is smaller than a chunk of {chunk}")
    return args


def _throughput(
    server: LMCacheServer,
    args: argparse.Namespace,
    deadline: float,
    rows: list[dict[str, Any]],
    classes: set[str],
) -> None:
    """Append one row per chunk size and client count to ``rows`` as each completes."""
    mp = multiprocessing.get_context("spawn")
    for chunk in args.chunk_list:
        for count in args.client_list:
            template = ClientSpec(
                server.endpoint,
                0,
                chunk,
                args.working_set,
                f"kvpool-peer-{chunk}-{count}",
                args.path,
                args.populate,
            )
            phases = _run_clients(mp, template, count, deadline)
            server.clear()
            if any(phase.mismatches for phase in phases):
                raise RuntimeError(f"retrieved bytes differ ({chunk} B chunks, {count} clients)")
            classes.update(phase.context_class for phase in phases)
            total = count * (args.working_set // chunk) * chunk
            rows.append(
                {
                    "chunk_bytes": chunk,
                    "clients": count,
                    "store_gbps": total / max(p.store_seconds for p in phases) / 1e9,
                    "retrieve_gbps": total / max(p.retrieve_seconds for p in phases) / 1e9,
                    "memcpy_gbps": total / max(p.memcpy_seconds for p in phases) / 1e9,
                }
            )


def _setup_notes(server: LMCacheServer, args: argparse.Namespace) -> list[str]:
    notes = ["server: lmcache " + " ".join(server.command[server.command.index("server") :])]
    if server.shm_path is not None:
        notes.append(
            "SHM pool prefaulted with posix_fallocate before the run, as kvpool's agent "
            "allocates its segment"
            if server.prefaulted
            else "SHM pool not prefaulted: the first stores fault its pages in"
        )
        notes.append(
            "each client's mapping of the pool populated (MADV_POPULATE_WRITE) before the "
            "timed phases, as a long-running worker's would be"
            if args.populate
            else "clients' mappings of the pool cold: the copies into it page-fault"
        )
    return notes


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, run the workload, stop the server; whatever happens, a result."""
    os.environ.update(NO_TRACKING)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # our clients' LMCache logging
    deadline = time.monotonic() + args.timeout
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(args.timeout)
    throughput: list[dict[str, Any]] = []
    lookup_us: dict[str, float | None] = {"p50": None, "p99": None}
    notes: list[str] = []
    classes: set[str] = set()
    server: LMCacheServer | None = None
    try:
        needed = max(args.client_list) * args.working_set + (64 << 20)
        server = LMCacheServer(
            needed / (EVICTION_WATERMARK - 0.1),
            max(args.client_list),
            args.path,
            not args.no_prefault,
        )
        _throughput(server, args, deadline, throughput, classes)
        p50, p99, noop = _lookup_latency(server.endpoint, args.lookups, args.path)
        lookup_us = {"p50": p50, "p99": p99}
        notes.append(
            "lookup = LOOKUP + WAIT_PREFETCH_STATUS (2 ZMQ round trips; the hit count comes "
            "with read locks; lock release and END_SESSION untimed); one NOOP round trip "
            f"p50 {noop:.0f} us"
        )
    except BenchTimeout:
        notes.append(f"stopped by --timeout {args.timeout}s; results are partial")
    except Exception as error:
        notes.append(f"failed: {type(error).__name__}: {error}")
        if server is not None:
            notes.append(f"server log tail: {server.tail()}")
    finally:
        signal.alarm(0)
        if server is not None:
            notes[:0] = _setup_notes(server, args)
            server.close()
    notes.append(
        f"client context class: {', '.join(sorted(classes)) or 'none'}; stores and retrieves "
        f"batched {BATCH_BYTES >> 20} MiB per request; chunk = [2, layers, {CHUNK_TOKENS} "
        f"tokens, hidden] {KV_DTYPE}; copies with torch copy_ on 1 thread; "
        f"{os.cpu_count()} CPUs"
    )
    return {
        "system": f"lmcache {importlib.metadata.version('lmcache')} mp server ({args.path})",
        "throughput": throughput,
        "lookup_us": lookup_us,
        "notes": "; ".join(notes),
    }


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(_parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
