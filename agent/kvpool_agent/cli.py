"""``kvpool``: tools for operators and tenants (tenant ids, benchmarks)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpool_agent.bench import l1 as bench_l1
from kvpool_agent.bench import restart as bench_restart
from kvpool_agent.bench import service as bench_service
from kvpool_agent.keys import tenant_id


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__)
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

    bench = commands.add_parser("bench", help="run a benchmark and print its table")
    benches = bench.add_subparsers(dest="bench", required=True)
    bench_l1.add_arguments(benches.add_parser("l1", help="L1 index and copy costs, in-process"))
    bench_service.add_arguments(
        benches.add_parser("service", help="store/retrieve through the ZMQ protocol vs memcpy")
    )
    bench_restart.add_arguments(
        benches.add_parser("restart", help="time to adopt a full segment after a restart")
    )

    args = parser.parse_args(argv)
    if args.command == "tenant-id":
        salt = args.salt if args.salt is not None else sys.stdin.readline().rstrip("\n")
        print(tenant_id(salt))
    else:
        {"l1": bench_l1.run, "service": bench_service.run, "restart": bench_restart.run}[
            args.bench
        ](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
