"""``kvpool bench tenants``: does polling ``/metrics`` slow lookups down, with many tenants?

A real agent holds one small chunk for each of ``--tenants`` tenants (so every
tenant's record legitimately exists). One client process then looks chunks up
(one chunk per request, rotating over the tenants, no read lock: one round trip)
for ``--seconds``: alone, with two processes polling ``GET /healthz`` in a loop
(the control: what two busy HTTP clients cost the agent and the machine without
any cache work), and with two processes polling ``GET /metrics`` and
``GET /v1/status``. Each runs ``--runs`` times, interleaved; the table prints the
median and range of lookups/s, the median time of one poll, and the ratio to
the control. Goal: /metrics polling / /healthz polling >= 0.8.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import multiprocessing.context
import multiprocessing.queues
import multiprocessing.synchronize
import platform
import statistics
import time

import httpx

from kvpool.client import AgentClient
from kvpool.common import problems
from kvpool.common.keys import tenant_id
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN, AgentProcess, running_agent
from kvpool.tools.bench.report import progress, table

CHUNK = b"k" * 1024
POLLERS = 2
CONTROL = f"{POLLERS} clients polling /healthz"
SETUPS: dict[str, tuple[str, ...]] = {
    "alone": (),
    CONTROL: ("/healthz",),
    f"{POLLERS} clients polling /metrics + /v1/status": ("/metrics", "/v1/status"),
}
"""What runs beside the lookups: the paths that each poller GETs in turn."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tenants", type=problems.number(int), default=100_000, help="tenants, one chunk each"
    )
    parser.add_argument(
        "--seconds", type=problems.number(float), default=3.0, help="lookup time per run"
    )
    parser.add_argument("--runs", type=problems.number(int), default=5, help="runs of each pairing")


def _tenant(number: int) -> str:
    return tenant_id(f"bench-tenant-{number}")


def _key(number: int) -> bytes:
    return hashlib.sha256(b"bench-tenant-chunk-%d" % number).digest()


def _populate(endpoint: str, tenants: int) -> None:
    with AgentClient(endpoint, token=ADMIN_TOKEN, timeout=60) as client:
        for number in range(tenants):
            stored = client.store_inline(_tenant(number), [_key(number)], [CHUNK]).stored
            assert stored == 1, f"tenant {number}: the L1 is too small for the bench"


def _lookups(endpoint: str, tenants: int, seconds: float) -> float:
    """Lookups per second of one client, each a hit of one chunk."""
    names = [_tenant(number) for number in range(min(tenants, 1000))]
    keys = [_key(number) for number in range(len(names))]
    done = 0
    with AgentClient(endpoint, token=ADMIN_TOKEN, timeout=60) as client:
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            turn = done % len(names)
            assert client.lookup(names[turn], [keys[turn]], lock=False).count == 1
            done += 1
    return done / elapsed


def _poll(
    http: str,
    paths: tuple[str, ...],
    polling: multiprocessing.synchronize.Semaphore,
    stop: multiprocessing.synchronize.Event,
    results: multiprocessing.queues.Queue[float],
) -> None:
    """GET ``paths`` in turn until told to stop; reports the median time of one GET."""
    samples = []
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=http, headers=headers, timeout=60) as client:
        while not stop.is_set():
            for path in paths:
                started = time.perf_counter()
                client.get(path).raise_for_status()
                samples.append(time.perf_counter() - started)
            if len(samples) == len(paths):
                polling.release()
    results.put(statistics.median(samples))


def _polled_lookups(
    context: multiprocessing.context.SpawnContext,
    agent: AgentProcess,
    paths: tuple[str, ...],
    tenants: int,
    seconds: float,
) -> tuple[float, float]:
    """Lookups/s while two processes poll ``paths``; and the median time of one GET."""
    polling = context.Semaphore(0)
    stop = context.Event()
    results: multiprocessing.queues.Queue[float] = context.Queue()
    pollers = [
        context.Process(target=_poll, args=(agent.http, paths, polling, stop, results))
        for _ in range(POLLERS)
    ]
    for poller in pollers:
        poller.start()
    try:
        for _ in pollers:  # each has started and finished its first round
            if not polling.acquire(timeout=120):
                raise RuntimeError("a poller did not start")
        rate = _lookups(agent.zmq, tenants, seconds)
    finally:
        stop.set()
    poll_seconds = statistics.median(results.get(timeout=120) for _ in pollers)
    for poller in pollers:
        poller.join()
    return rate, poll_seconds


def _spread(samples: list[float], spec: str) -> str:
    low, mid, high = min(samples), statistics.median(samples), max(samples)
    return f"{mid:{spec}} ({low:{spec}}-{high:{spec}})"


def run(args: argparse.Namespace) -> None:
    context = multiprocessing.get_context("spawn")
    l1_mib = max(64, args.tenants * 4 // 1024 * 2)  # one 4 KiB page each, under the watermark
    with running_agent({"L1_SIZE": f"{l1_mib}Mi", "PAGE_SIZE": "4Ki"}) as agent:
        started = time.perf_counter()
        _populate(agent.zmq, args.tenants)
        populate_seconds = time.perf_counter() - started
        rates: dict[str, list[float]] = {name: [] for name in SETUPS}
        polls: dict[str, list[float]] = {name: [] for name in SETUPS}
        for number in range(args.runs):
            progress(f"run {number + 1} of {args.runs}")
            for name, paths in SETUPS.items():
                if paths:
                    rate, poll = _polled_lookups(context, agent, paths, args.tenants, args.seconds)
                    polls[name].append(poll * 1e3)
                else:
                    rate = _lookups(agent.zmq, args.tenants, args.seconds)
                rates[name].append(rate)
    control = rates[CONTROL]
    rows = [
        [
            name,
            _spread(rate, ",.0f"),
            _spread(polls[name], ".1f") if polls[name] else "-",
            _spread([r / c for r, c in zip(rate, control, strict=True)], ".2f"),
        ]
        for name, rate in rates.items()
    ]
    print(
        table(
            f"Lookups/s of one ZMQ client (one chunk, no lock), {args.tenants:,} tenants with a "
            f"chunk each; median (min-max) of {args.runs} runs of {args.seconds:g} s; "
            f"CPU: {_cpu()}, {multiprocessing.cpu_count()} cores",
            ["while", "lookups/s", "one GET (ms)", f"ratio to {CONTROL}"],
            rows,
        )
    )
    print(f"populating took {populate_seconds:.0f} s")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
