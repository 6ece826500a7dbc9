"""``kvpool``: tools for operators and tenants (tenant ids, the doctor, the prefix index,
benchmarks)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpool_agent.bench import chains as bench_chains
from kvpool_agent.bench import connector as bench_connector
from kvpool_agent.bench import index as bench_index
from kvpool_agent.bench import l1 as bench_l1
from kvpool_agent.bench import l2 as bench_l2
from kvpool_agent.bench import restart as bench_restart
from kvpool_agent.bench import service as bench_service
from kvpool_agent.bench import tenants as bench_tenants
from kvpool_agent.bench import writeback as bench_writeback
from kvpool_agent.doctor import command as doctor
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

    doctor.add_arguments(
        commands.add_parser(
            "doctor",
            help="check a deployment end to end, as a vLLM pod sees it",
            description=doctor.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )

    commands.add_parser(
        "index",
        add_help=False,  # its arguments, --help included, go to the index's own parser
        help="run the pool-wide prefix index (cache-aware routing for gateways)",
    )

    bench = commands.add_parser("bench", help="run a benchmark and print its table")
    benches = bench.add_subparsers(dest="bench", required=True)
    bench_l1.add_arguments(benches.add_parser("l1", help="L1 index and copy costs, in-process"))
    bench_chains.add_arguments(
        benches.add_parser("chains", help="reachable prefix of a long prompt stored in steps")
    )
    bench_service.add_arguments(
        benches.add_parser("service", help="store/retrieve through the ZMQ protocol vs memcpy")
    )
    bench_connector.add_arguments(
        benches.add_parser(
            "connector", help="TTFT: kvpool connector vs no connector vs ExampleConnector"
        )
    )
    bench_l2.add_arguments(
        benches.add_parser("l2", help="NVMe and S3 adapters vs raw file I/O and raw boto3")
    )
    bench_writeback.add_arguments(
        benches.add_parser("writeback", help="store latency with a saturated write-back queue")
    )
    bench_restart.add_arguments(
        benches.add_parser("restart", help="time to adopt a full segment after a restart")
    )
    bench_tenants.add_arguments(
        benches.add_parser("tenants", help="lookups/s while /metrics is polled, many tenants")
    )
    bench_index.add_arguments(
        benches.add_parser("index", help="prefix index: query latency, events/s, memory")
    )

    args, index_arguments = parser.parse_known_args(argv)
    if index_arguments and args.command != "index":
        parser.error(f"unrecognized arguments: {' '.join(index_arguments)}")
    if args.command == "tenant-id":
        salt = args.salt if args.salt is not None else sys.stdin.readline().rstrip("\n")
        print(tenant_id(salt))
    elif args.command == "doctor":
        return doctor.run(args)
    elif args.command == "index":
        # Imported here: the web stack is not needed by the other tools.
        from kvpool_agent.index import server as index_server

        return index_server.main(index_arguments)
    else:
        {
            "l1": bench_l1.run,
            "chains": bench_chains.run,
            "service": bench_service.run,
            "restart": bench_restart.run,
            "l2": bench_l2.run,
            "writeback": bench_writeback.run,
            "connector": bench_connector.run,
            "index": bench_index.run,
            "tenants": bench_tenants.run,
        }[args.bench](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
