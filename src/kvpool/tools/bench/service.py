"""``kvpool bench service``: the agent's ZMQ protocol end to end, against raw memcpy.

A real ``kvpool-agent`` process serves 1 and 4 client processes. Each client
stores its own chunks (prepare_store, copy into the mapped segment,
commit_store; batches of up to 64 MiB) totalling ``--working-set-mib``, then
retrieves them all (lookup with read locks, copy out, release), checking the
bytes. Throughput is all clients' bytes over the wall time of the phase
(clients start together at a barrier). The baseline is a raw memcpy of the same
bytes in the same client processes, from the same source buffer into a private
buffer of the same size, so both sides move the same working set through DRAM.
Also the round trip of a locked lookup of a 64-chunk cached prefix, p50/p99, next
to the agent's ``ping`` (the protocol without cache work) and to the transport's
floor: a bare pyzmq ROUTER in another process echoing a reply of the same size to
a request of the same size, over the same TCP loopback.

With ``--lmcache-python``, the same workload runs against LMCache's
multiprocess server (the repository's ``benchmarks/lmcache_peer.py``, which is not
shipped, in that interpreter) and both are printed side by side.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import multiprocessing
import multiprocessing.context
import multiprocessing.queues
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import zmq

from kvpool.client import AgentClient, copy_in, copy_out
from kvpool.common import problems
from kvpool.common import protocol as p
from kvpool.common.keys import tenant_id
from kvpool.common.transfer_results import LookupResult
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN, running_agent
from kvpool.tools.bench.report import goal, table

TENANT = tenant_id("bench")
BATCH_BYTES = 64 << 20
OURS = "kvpool agent"
RATIO_GOAL, RATIO_GOAL_FROM = 0.8, 2 << 20
"""kvpool's store and retrieve move >= RATIO_GOAL of memcpy's GB/s from chunks of 2 MiB."""
LOOKUP_GOAL_US = 100
"""kvpool's locked lookup round trip: p50 at most this."""
LOOKUP_CHUNKS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--working-set-mib", type=problems.number(int), default=256, help="MiB per client"
    )
    parser.add_argument(
        "--chunk-sizes",
        type=problems.numbers(int),
        default=[256 << 10, 2 << 20, 32 << 20],
        help="bytes, comma-separated (default 262144,2097152,33554432)",
    )
    parser.add_argument(
        "--clients",
        type=problems.numbers(int),
        default=[1, 4],
        help="client counts, comma-separated (default 1,4)",
    )
    parser.add_argument("--lookups", type=problems.number(int), default=2000, help="timed lookups")
    parser.add_argument(
        "--lmcache-python", type=Path, help="python of a venv with lmcache==0.5.6, to compare"
    )
    parser.add_argument(
        "--lmcache-peer",
        type=Path,
        default=Path("benchmarks/lmcache_peer.py"),
        help="the repository's LMCache workload script (default: %(default)s, from the root)",
    )


@dataclass(frozen=True)
class Phase:
    store_seconds: float
    retrieve_seconds: float
    memcpy_seconds: float
    mismatches: int


def _private_buffer(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)


def _client(endpoint: str, worker: int, chunk: int, working_set: int, barrier: Barrier) -> Phase:
    count = working_set // chunk
    source = _private_buffer(count * chunk)
    source.write(os.urandom(1 << 20) * (count * chunk >> 20))
    target = _private_buffer(count * chunk)
    source_view, target_view = memoryview(source), memoryview(target)
    keys = [hashlib.sha256(b"%d-%d-%d" % (worker, chunk, i)).digest() for i in range(count)]
    per_batch = max(1, BATCH_BYTES // chunk)
    batches = [range(i, min(i + per_batch, count)) for i in range(0, count, per_batch)]
    with AgentClient(
        endpoint, token=ADMIN_TOKEN, client_name=f"bench-{worker}", timeout=60
    ) as client:
        files = client.files()
        barrier.wait()
        started = time.perf_counter()
        # The raw memcpy of the same bytes, chunk by chunk like the workload (one huge
        # memcpy takes glibc's non-temporal path and is not what either system can do).
        for i in range(count):
            target_view[i * chunk : (i + 1) * chunk] = source_view[i * chunk : (i + 1) * chunk]
        memcpy_seconds = time.perf_counter() - started

        barrier.wait()
        started = time.perf_counter()
        for batch in batches:
            plan = client.prepare_store(TENANT, [keys[i] for i in batch], [chunk] * len(batch))
            assert plan.lease is not None, plan.refused
            copy_in(files, plan, [source_view[i * chunk : (i + 1) * chunk] for i in batch])
            client.commit_store(plan.lease)
        store_seconds = time.perf_counter() - started

        target_view[:] = bytes(len(target_view))  # untimed: the check below sees only retrieves
        barrier.wait()
        started = time.perf_counter()
        for batch in batches:
            hit = client.lookup(TENANT, [keys[i] for i in batch])
            assert hit.lease is not None and hit.count == len(batch)
            for i, offset in zip(batch, hit.offsets, strict=True):
                target_view[i * chunk : (i + 1) * chunk] = files.chunk(hit.file, offset, chunk)
            client.release(hit.lease)
        retrieve_seconds = time.perf_counter() - started
        mismatches = int(source_view != target_view)
    source_view.release()
    target_view.release()
    return Phase(store_seconds, retrieve_seconds, memcpy_seconds, mismatches)


def _client_process(
    job: tuple[str, int, int, int], barrier: Barrier, results: multiprocessing.queues.Queue[Phase]
) -> None:
    endpoint, worker, chunk, working_set = job
    results.put(_client(endpoint, worker, chunk, working_set, barrier))


def _run_clients(
    context: multiprocessing.context.SpawnContext,
    endpoint: str,
    count: int,
    chunk: int,
    working_set: int,
) -> list[Phase]:
    barrier = context.Barrier(count)
    results: multiprocessing.queues.Queue[Phase] = context.Queue()
    workers = [
        context.Process(
            target=_client_process, args=((endpoint, w, chunk, working_set), barrier, results)
        )
        for w in range(count)
    ]
    for worker in workers:
        worker.start()
    phases = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    return phases


def _percentiles(
    call: Callable[[], object], count: int, after: Callable[[], object] = lambda: None
) -> tuple[float, float]:
    """p50 and p99 in microseconds of ``count`` calls (after 200 untimed ones); ``after``
    runs after each call, untimed."""
    samples = []
    for _ in range(count + 200):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
        after()
    timed = sorted(samples[200:])
    return statistics.median(timed) * 1e6, timed[int(len(timed) * 0.99)] * 1e6


def _lookup_latency(endpoint: str, lookups: int) -> dict[str, tuple[float, float]]:
    """Round trips of a locked 64-chunk lookup (its release untimed), of a ping, and of the
    same request and reply bytes through bare pyzmq."""
    keys = [hashlib.sha256(b"lookup-%d" % i).digest() for i in range(LOOKUP_CHUNKS)]
    with AgentClient(endpoint, token=ADMIN_TOKEN) as client:
        client.store(TENANT, keys, [bytes(4096)] * LOOKUP_CHUNKS)
        hits: list[LookupResult] = []

        def lookup() -> None:
            hits.append(client.lookup(TENANT, keys))

        def release() -> None:
            hit = hits.pop()
            assert hit.lease is not None and hit.count == LOOKUP_CHUNKS
            client.release(hit.lease)

        result = {"lookup": _percentiles(lookup, lookups, release)}
        result["ping"] = _percentiles(client.ping, lookups)
        hit = client.lookup(TENANT, keys)
        assert hit.lease is not None and copy_out(client.files(), hit)[0] == bytes(4096)
        client.release(hit.lease)
    request = p.encode(p.Lookup(1, 1, TENANT, keys))
    reply = p.encode(p.LookupReply(1, hit.lease, hit.offsets, hit.sizes))
    result["floor"] = _zmq_floor(request, reply, lookups)
    return result


def _echo(reply: bytes, endpoints: multiprocessing.queues.Queue[str]) -> None:
    """A bare ROUTER: answers every request with ``reply`` until it gets an empty one."""
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    socket.bind("tcp://127.0.0.1:*")
    endpoints.put(socket.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        identity, request = socket.recv_multipart()
        socket.send_multipart([identity, reply])
        if not request:
            break
    socket.close()


def _zmq_floor(request: bytes, reply: bytes, count: int) -> tuple[float, float]:
    """The transport's floor: the same bytes each way through bare pyzmq, another process."""
    context = multiprocessing.get_context("spawn")
    endpoints: multiprocessing.queues.Queue[str] = context.Queue()
    echo = context.Process(target=_echo, args=(reply, endpoints))
    echo.start()
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoints.get(timeout=60))

    def roundtrip() -> None:
        socket.send(request)
        socket.recv()

    try:
        return _percentiles(roundtrip, count)
    finally:
        socket.send(b"")
        socket.recv()
        socket.close()
        echo.join(10)


def _ours(chunks: list[int], clients: list[int], working_set: int, lookups: int) -> dict[str, Any]:
    settings = {"L1_SIZE": str(max(clients) * working_set + (256 << 20)), "PAGE_SIZE": "65536"}
    context = multiprocessing.get_context("spawn")
    results = []
    with running_agent(settings) as agent:
        for chunk in chunks:
            for count in clients:
                phases = _run_clients(context, agent.zmq, count, chunk, working_set)
                assert all(phase.mismatches == 0 for phase in phases), "bytes differ"
                with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
                    client.clear()
                total = count * (working_set // chunk) * chunk
                results.append(
                    {
                        "chunk_bytes": chunk,
                        "clients": count,
                        "store_gbps": total / max(p.store_seconds for p in phases) / 1e9,
                        "retrieve_gbps": total / max(p.retrieve_seconds for p in phases) / 1e9,
                        "memcpy_gbps": total / max(p.memcpy_seconds for p in phases) / 1e9,
                    }
                )
        latency = _lookup_latency(agent.zmq, lookups)
    p50, p99 = latency["lookup"]
    return {
        "system": OURS,
        "throughput": results,
        "lookup_us": {"p50": p50, "p99": p99},
        "also_us": {
            "kvpool agent: ping (no cache work)": latency["ping"],
            "bare pyzmq: same bytes each way (floor)": latency["floor"],
        },
    }


def _lmcache(python: Path, args: argparse.Namespace) -> dict[str, Any]:
    output = subprocess.run(
        [
            python,
            args.lmcache_peer,
            "--working-set-mib",
            str(args.working_set_mib),
            "--chunk-sizes",
            _listed(args.chunk_sizes),
            "--clients",
            _listed(args.clients),
            "--lookups",
            str(args.lookups),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    result: dict[str, Any] = json.loads(output.stdout.strip().splitlines()[-1])
    return result


def _listed(values: list[int]) -> str:
    return ",".join(map(str, values))


def _ratio(ratio: float, held: bool) -> str:
    """A ratio to memcpy; marked where it misses the goal it is ``held`` to."""
    shown = f"{ratio:.2f}"
    return goal(shown, ratio, RATIO_GOAL, at_least=True) if held else shown


def _rows(result: dict[str, Any]) -> list[list[str]]:
    """Throughput rows; kvpool's ratios to memcpy marked where they miss the goal."""
    rows = []
    for entry in result["throughput"]:
        memcpy = entry["memcpy_gbps"]
        held = result["system"] == OURS and entry["chunk_bytes"] >= RATIO_GOAL_FROM
        rows.append(
            [
                result["system"],
                f"{entry['chunk_bytes'] >> 10} KiB",
                str(entry["clients"]),
                f"{memcpy:.2f}",
                f"{entry['store_gbps']:.2f}",
                _ratio(entry["store_gbps"] / memcpy, held),
                f"{entry['retrieve_gbps']:.2f}",
                _ratio(entry["retrieve_gbps"] / memcpy, held),
            ]
        )
    return rows


def run(args: argparse.Namespace) -> None:
    working_set = args.working_set_mib << 20
    if args.lmcache_python and not args.lmcache_peer.is_file():  # before the long part
        raise SystemExit(
            f"--lmcache-python needs the repository's LMCache script, not found at "
            f"{args.lmcache_peer}: run from a checkout's root or pass --lmcache-peer"
        )
    results = [_ours(args.chunk_sizes, args.clients, working_set, args.lookups)]
    if args.lmcache_python:
        results.append(_lmcache(args.lmcache_python, args))
    header = ["system", "chunk", "clients", "memcpy GB/s", "store GB/s", "ratio"]
    header += ["retrieve GB/s", "ratio"]
    rows = [row for result in results for row in _rows(result)]
    print(
        table(
            f"Store/retrieve through the protocol vs raw memcpy (goal ratio >= {RATIO_GOAL} at "
            f">= {RATIO_GOAL_FROM >> 20} MiB), "
            f"{args.working_set_mib} MiB per client",
            header,
            rows,
        )
    )
    print()
    floor = results[0]["also_us"]["bare pyzmq: same bytes each way (floor)"][0]
    latency_rows = [
        [
            name,
            goal(f"{p50:.0f}", p50, LOOKUP_GOAL_US) if name == OURS else f"{p50:.0f}",
            f"{p99:.0f}",
            f"{p50 / floor:.2f}",
        ]
        for name, (p50, p99) in [
            *((r["system"], (r["lookup_us"]["p50"], r["lookup_us"]["p99"])) for r in results),
            *results[0]["also_us"].items(),
        ]
    ]
    print(
        table(
            f"Locked lookup round trip, {LOOKUP_CHUNKS}-chunk cached prefix "
            f"(goal p50 <= {LOOKUP_GOAL_US} us)",
            ["system", "p50 us", "p99 us", "p50 / floor"],
            latency_rows,
        )
    )
    for result in results:
        if result.get("notes"):
            print(f"\n{result['system']}: {result['notes']}")
