"""Where a peer pull's time goes: the peer bench's two agents (:mod:`benchmarks.peer_agents`),
pulls and nothing else, for each ``--max-transfers`` (the transfers an agent serves at once,
and the requests a puller makes at once, each on a connection of its own): the rate (of
the pulls' own seconds, as :mod:`benchmarks.peer` times them); each agent's user and
system CPU seconds per GB; the share of a core its busiest threads used; and the cores the
machine (``/proc/stat``, every CPU it has) left idle meanwhile.
Where the machine idles while no thread is busy, the pull waits on something other than
the CPU (docs/platform/peers.md, "Figures").

As root, from a checkout's root (as :mod:`benchmarks.peer`)::

    sudo .venv/bin/python -m benchmarks.peer_pull_profile --chunk-mib 0.25 --max-transfers 2,4,8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peer import PROGRAM as PEER_BENCH
from benchmarks.peer import PROTECTIONS, chunk_counts, cpu_times, l1_bytes
from benchmarks.peer_agents import peer_pair
from kvpool.common import problems
from kvpool.tools.bench import cpu_features
from kvpool.tools.bench import report as reports
from kvpool.tools.bench.local.hosts import Hosts, HostsUnavailable
from kvpool.tools.bench.local.peers import TRANSPORTS
from kvpool.tools.bench.report import add_chunk_mib, chunk_label, command, machine

PROGRAM = "python -m benchmarks.peer_pull_profile"
BUSIEST = 4
"""Threads shown per agent, busiest first."""
SIDES = ("holder", "puller")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_chunk_mib(parser)
    parser.add_argument("--mib", type=problems.number(int), default=128, help="MiB per pull")
    parser.add_argument(
        "--pulls", type=problems.number(int), default=20, help="timed pulls of each size"
    )
    parser.add_argument("--transport", choices=TRANSPORTS, default="tcp")
    parser.add_argument("--wire", choices=PROTECTIONS, default="sealed")
    parser.add_argument(
        "--max-transfers",
        type=problems.numbers(int),
        default=[4],
        help="the agents' peers.max_transfers, comma-separated: a pair of agents each",
    )
    cpu_features.add_as_avx2(parser)


@dataclass(frozen=True)
class Snapshot:
    """What the machine and both agents had spent at one moment."""

    at: float
    idle: float
    """The machine's idle CPU seconds, all CPUs."""
    agents: tuple[tuple[float, float], ...]
    """Each agent's user and system CPU seconds."""
    threads: tuple[dict[str, float], ...]
    """Each agent's CPU seconds by thread id."""

    @classmethod
    def take(cls, pids: Sequence[int]) -> Snapshot:
        return cls(
            time.perf_counter(),
            _idle_seconds(),
            tuple(cpu_times(Path(f"/proc/{pid}/stat")) for pid in pids),
            tuple(_threads(pid) for pid in pids),
        )


def _idle_seconds() -> float:
    """The idle CPU seconds of the machine since boot (``/proc/stat``, every CPU)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[4]) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[str, float]:
    """The CPU seconds of each thread of ``pid`` (one that ends meanwhile is left out)."""
    spent = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            spent[task.name] = sum(cpu_times(task / "stat"))
        except (OSError, ValueError):
            continue
    return spent


def row(
    size: int, transfers: int, moved: float, pulling: float, snapshots: tuple[Snapshot, Snapshot]
) -> list[str]:
    """The table's row of ``moved`` GB of chunks of ``size`` pulled in ``pulling`` seconds,
    between the two ``snapshots``."""
    before, after = snapshots
    seconds = after.at - before.at
    cells = [chunk_label(size), str(transfers), f"{moved / pulling:.2f}"]
    for was, now in zip(before.agents, after.agents, strict=True):
        user, system = ((spent - had) / moved for had, spent in zip(was, now, strict=True))
        cells.append(f"{user:.2f} / {system:.2f}")
    for had, spent in zip(before.threads, after.threads, strict=True):
        busy = sorted((spent[tid] - had.get(tid, 0.0) for tid in spent), reverse=True)
        cells.append(" ".join(f"{cpu / seconds:.2f}" for cpu in busy[:BUSIEST]))
    cells.append(f"{(after.idle - before.idle) / seconds:.2f}")
    return cells


def run(args: argparse.Namespace) -> None:
    cpu_features.take(args)
    try:
        hosts = Hosts(2).start()
    except HostsUnavailable as error:
        raise SystemExit(f"{PROGRAM} needs two hosts on this machine: {error}") from None
    counts = chunk_counts(args)
    rows = []
    with hosts, tempfile.TemporaryDirectory(prefix="kvpool-bench-pull-") as work:
        holder, puller = hosts.hosts
        for transfers in args.max_transfers:
            with peer_pair(
                holder,
                puller,
                Path(work) / f"max-transfers-{transfers}",
                holder_l1=l1_bytes(sum(size * count for size, count in counts.items())),
                puller_l1=l1_bytes(max(size * count for size, count in counts.items())),
                wire_protection=args.wire,
                transport=args.transport,
                max_transfers=transfers,
            ) as pair:
                for size, count in counts.items():
                    pair.hold(size, count)
                    pair.pull(size, count)  # the warm-up: connections, page faults
                    before = Snapshot.take(pair.pids)
                    pulling = sum(pair.pull(size, count) for _ in range(args.pulls))
                    after = Snapshot.take(pair.pids)
                    moved = args.pulls * count * size / 1e9
                    rows.append(row(size, transfers, moved, pulling, (before, after)))
    header = [
        "chunk",
        "max transfers",
        "GB/s",
        *(f"{side} user / sys s/GB" for side in SIDES),
        *(f"{side}'s busiest threads, cores" for side in SIDES),
        f"machine idle, cores of {os.cpu_count()}",
    ]
    title = (
        f"Peer pulls alone, {args.transport} {args.wire}, {args.mib} MiB each, "
        f"{args.pulls} timed after a warm-up (as {PEER_BENCH} pulls)"
    )
    print(reports.table(title, header, rows))
    print("\n" + command(PROGRAM, args))
    print(machine())


def main(argv: Sequence[str] | None = None) -> int:
    summary = "where a peer pull's time goes: CPU per GB, busiest threads, idle cores"
    arguments = sys.argv[1:] if argv is None else argv
    return reports.main(PROGRAM, summary, add_arguments, run, arguments)


if __name__ == "__main__":
    sys.exit(main())
