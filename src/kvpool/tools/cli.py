"""``kvpool``: tools for operators and tenants (tenant ids, the doctor, the prefix index,
benchmarks)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

from kvpool import __version__
from kvpool.common.extras import require_extra
from kvpool.common.keys import tenant_id
from kvpool.common.problems import ArgumentParser


class Bench(Protocol):
    """A bench's module: its flags, and the bench itself."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> None: ...


# Each bench's module imports torch, vLLM or boto3 as it loads: imported only when it runs.
def _l1() -> Bench:
    from kvpool.tools.bench import l1

    return l1


def _chains() -> Bench:
    from kvpool.tools.bench import chains

    return chains


def _service() -> Bench:
    from kvpool.tools.bench import service

    return service


def _connector() -> Bench:
    from kvpool.tools.bench import connector

    return connector


def _windows() -> Bench:
    from kvpool.tools.bench import windows

    return windows


def _spaces() -> Bench:
    from kvpool.tools.bench import spaces

    return spaces


def _l2() -> Bench:
    from kvpool.tools.bench import l2

    return l2


def _writeback() -> Bench:
    from kvpool.tools.bench import writeback

    return writeback


def _restart() -> Bench:
    from kvpool.tools.bench import restart

    return restart


def _tenants() -> Bench:
    from kvpool.tools.bench import tenants

    return tenants


def _index() -> Bench:
    from kvpool.tools.bench import index

    return index


def _route() -> Bench:
    from kvpool.tools.bench import route

    return route


def _cluster() -> Bench:
    from kvpool.tools.bench.cluster import bench

    return bench


def _gpu() -> Bench:
    from kvpool.tools.bench import gpu

    return gpu


BENCHES: dict[str, tuple[str, Callable[[], Bench]]] = {
    "l1": ("L1 index and copy costs, in-process", _l1),
    "chains": ("reachable prefix of a long prompt stored in steps", _chains),
    "service": ("store/retrieve through the ZMQ protocol vs memcpy", _service),
    "connector": (
        "TTFT vs floor, vLLM prefix cache, ExampleConnector, recompute; queued steps",
        _connector,
    ),
    "windows": (
        "sliding-window mix vs all full: bytes per chunk, TTFT vs recompute and native",
        _windows,
    ),
    "spaces": (
        "N tenants sharing a system prompt: stored bytes and reader TTFT, space vs plain salts",
        _spaces,
    ),
    "l2": ("NVMe and S3 adapters vs raw file I/O and raw boto3", _l2),
    "writeback": ("store latency with a saturated write-back queue", _writeback),
    "restart": ("time to adopt a full segment after a restart", _restart),
    "tenants": ("lookups/s while /metrics is polled, many tenants", _tenants),
    "index": ("prefix index: query latency, events/s, memory", _index),
    "route": (
        "endpoint picker: decision time vs key hashing, latency it adds to Envoy",
        _route,
    ),
    "cluster": (
        "the whole system on two hosts under a multi-tenant workload vs round robin, LMCache",
        _cluster,
    ),
    "gpu": (
        "copies between GPU KV blocks and the agent's chunk files vs the raw PCIe copy",
        _gpu,
    ),
}
"""Each ``kvpool bench NAME``: its summary, and its module's import."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="kvpool", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    tenant = commands.add_parser(
        "tenant-id",
        help="print the tenant id of a cache salt",
        description=(
            "Print the tenant id that kvpool derives from a vLLM cache_salt. The salt is read "
            "from standard input unless given (an argument shows up in shell history)."
        ),
    )
    tenant.add_argument("salt", nargs="?", help="the cache_salt; default: read standard input")

    # The tools below import their modules (and their extra's libraries) only when they run,
    # so `kvpool tenant-id` loads none of them: each parses the rest of the command line with
    # a parser of its own, --help included.
    commands.add_parser(
        "doctor", add_help=False, help="check a deployment end to end, as a vLLM pod sees it"
    )
    commands.add_parser(
        "index",
        add_help=False,
        help="run the pool-wide prefix index (cache-aware routing for gateways)",
    )
    bench = commands.add_parser("bench", help="run a benchmark and print its table")
    benches = bench.add_subparsers(dest="bench", required=True)
    for name, (summary, _) in BENCHES.items():
        benches.add_parser(name, add_help=False, help=summary)

    args, rest = parser.parse_known_args(argv)
    if args.command == "tenant-id":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        salt = args.salt if args.salt is not None else sys.stdin.readline().rstrip("\n")
        print(tenant_id(salt))
        return 0
    if args.command == "index":
        require_extra("index", "kvpool-index")
        from kvpool.index import server as index_server

        return index_server.main(rest)
    if args.command == "doctor":
        require_extra("agent", "kvpool doctor")
        from kvpool.tools.doctor import command as doctor

        tool = ArgumentParser(
            prog="kvpool doctor",
            description=doctor.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        doctor.add_arguments(tool)
        return doctor.run(tool.parse_args(rest))
    command = f"kvpool bench {args.bench}"
    require_extra("bench", command)
    if args.bench in {"index", "route", "cluster"}:
        require_extra("index", command)
    summary, load = BENCHES[args.bench]
    bench_module = load()
    from kvpool.tools.bench import report

    return report.main(command, summary, bench_module.add_arguments, bench_module.run, rest)


if __name__ == "__main__":
    sys.exit(main())
