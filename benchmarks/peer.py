"""The peer bench: chunks moving between two nodes' agents through the peer tier, against a
plain socket moving the same bytes over the same link; and the time to first token of a
reader whose KV another node's engine stored, through the peer, through S3, recomputed.

As root, from a checkout's root (the repository's test venv: it builds on the tests'
agents, so it is not a shipped ``kvpool bench``)::

    sudo .venv/bin/python -m benchmarks.peer [--chunk-mib 2,32 --mib 256 --runs 5 ...]

Two hosts on this machine, A and B (network namespaces cabled by veth pairs to one bridge:
:mod:`kvpool.tools.bench.local.hosts`); per chunk size of ``--chunk-mib``, ``--mib`` MiB of
chunks move from A to B:

* plain socket: one Python TCP connection from a sender in A to a receiver in B,
  ``sendall`` of memoryviews into ``recv_into`` a touched buffer, no framing and no
  request per chunk: the most this link carries (:mod:`benchmarks.peer_socket`);
* NIXL raw, where NIXL is installed: the transfer engine the field's peer tiers run on
  (UCX held to TCP) writing the same chunks from A into B with no kvpool code, one NIXL
  request per transfer (:mod:`benchmarks.peer_nixl`): the engine's raw rate over this link;
* peer, for each wire protection of ``--wire`` (``sealed``: AES-256-GCM ciphertext;
  ``integrity``: the plaintext under its tag; ``peers.wire_protection``): agent A holds the
  chunks in its L1; agent B, whose only lower tier is A, pulls them on a lookup with
  prefetch, timed until every chunk is loaded into its L1 (:mod:`benchmarks.peer_agents`;
  one pair of agents per protection, on peer ports of their own). Every pull is then
  checked byte for byte (untimed). ``--skip-peer`` measures the link alone.

Each of ``--runs`` runs moves every size once on each side, the side that goes first
turning with the run, after one untimed warm-up run (connections, page faults). Figures:
GB/s of each run, median [min-max]; the ratio is a side over the plain socket within one
run. Goals, from 2 MiB chunks on: sealed >= 0.8 of the plain socket; integrity >= 0.9 (the
link's rate with the cipher's pass gone).

Then (unless ``--skip-ttft``) the readers' table, on the same hosts with agents and vLLM
engines of its own: :mod:`benchmarks.peer_ttft`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import peer_nixl, peer_ttft
from benchmarks.peer_agents import PeerPair, peer_pair
from benchmarks.peer_socket import plain_link
from kvpool.common import problems
from kvpool.common.names import DEFAULT_PEER_PORT
from kvpool.tools.bench import report as reports
from kvpool.tools.bench.local.hosts import Hosts, HostsUnavailable
from kvpool.tools.bench.report import (
    add_chunk_mib,
    chunk_bytes,
    chunk_label,
    command,
    goal,
    machine,
    median_spread,
    runs_said,
    table,
)

PROGRAM = "python -m benchmarks.peer"

MiB = 1 << 20
SOCKET = "plain socket"
PROTECTIONS = ("sealed", "integrity")
GOALS = {"sealed": 0.8, "integrity": 0.9}
"""Each protection's side moves at least this share of the plain socket's GB/s, for chunks
of GOAL_FROM bytes and up."""
GOAL_FROM = 2 * MiB


def side_name(protection: str) -> str:
    return f"peer, {protection}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_chunk_mib(parser)
    parser.add_argument(
        "--mib", type=problems.number(int), default=256, help="MiB moved per transfer"
    )
    parser.add_argument(
        "--runs", type=problems.number(int), default=5, help="timed runs of every size and side"
    )
    parser.add_argument(
        "--skip-peer", action="store_true", help="no agents: the plain socket (the link) alone"
    )
    parser.add_argument(
        "--wire",
        type=_protections,
        default=list(PROTECTIONS),
        help="the agents' wire protections, each a side of its own (default: sealed,integrity)",
    )
    peer_ttft.add_arguments(parser)


def _protections(text: str) -> list[str]:
    chosen = [item.strip() for item in text.split(",")]
    wrong = [item for item in chosen if item not in PROTECTIONS]
    if wrong or not chosen:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(PROTECTIONS)}, not {text!r}")
    return list(dict.fromkeys(chosen))


@dataclass(frozen=True)
class Side:
    """One way to move chunks from host A to host B: a transfer (``size, count`` -> its
    seconds), and the processes on A and on B whose CPU it costs."""

    transfer: Callable[[int, int], float]
    pids: tuple[int, int]


@dataclass
class Results:
    seconds: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    """Per (side, chunk size), the seconds of each timed run."""
    cpu: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    """Per (side, chunk size), the CPU seconds of its process on A and on B in all timed
    runs together."""
    intact: bool = True
    """Every pull of the peer sides was the holder's bytes."""
    unmeasured: dict[str, str] = field(default_factory=dict)
    """Sides not measured on this machine, and why."""


def run(args: argparse.Namespace) -> None:
    try:
        hosts = Hosts(2).start()
    except HostsUnavailable as error:
        raise SystemExit(f"{PROGRAM} needs two hosts on this machine: {error}") from None
    counts = _counts(args)
    with hosts, tempfile.TemporaryDirectory(prefix="kvpool-bench-peer-") as work:
        transfers = _transfers(hosts, Path(work) / "transfers", counts, args)
        readers = None if args.skip_ttft else peer_ttft.measure(hosts, Path(work) / "ttft", args)
        mtu = Path(f"/sys/class/net/{hosts.hosts[0].link}/mtu").read_text().strip()
    print(report(transfers, args, counts, mtu), flush=True)
    if readers is not None:
        print("\n" + peer_ttft.report(readers, args))
    print("\n" + command(PROGRAM, args))
    print(machine())


def _transfers(
    hosts: Hosts, workdir: Path, counts: dict[int, int], args: argparse.Namespace
) -> Results:
    """The transfer table's runs (the plain link and the agents started here, stopped on
    return)."""
    a, b = hosts.hosts
    largest = max(size * count for size, count in counts.items())
    with contextlib.ExitStack() as stack:
        link = plain_link(a, b, largest)
        stack.callback(link.close)
        sides = {SOCKET: Side(link.transfer, link.pids)}
        unmeasured = {}
        if (missing := peer_nixl.available()) is None:
            raw = peer_nixl.nixl_link(a, b, largest)
            stack.callback(raw.close)
            sides[peer_nixl.NAME] = Side(raw.transfer, raw.pids)
        else:
            unmeasured[peer_nixl.NAME] = missing
        pairs: dict[str, PeerPair] = {}
        for number, protection in enumerate([] if args.skip_peer else args.wire):
            pair = stack.enter_context(
                peer_pair(
                    a,
                    b,
                    workdir / protection,
                    holder_l1=_l1_bytes(sum(size * count for size, count in counts.items())),
                    puller_l1=_l1_bytes(largest),
                    port=DEFAULT_PEER_PORT + number,
                    wire_protection=protection,
                )
            )
            for size, count in counts.items():
                pair.hold(size, count)
            pairs[side_name(protection)] = pair
            sides[side_name(protection)] = Side(pair.pull, pair.pids)
        results = measure(sides, counts, args.runs, pairs)
        results.unmeasured = unmeasured
        return results


def _counts(args: argparse.Namespace) -> dict[int, int]:
    """Chunks per transfer, by chunk size in bytes: ``--mib``'s worth, at least one."""
    sizes = [chunk_bytes(mib) for mib in args.chunk_mib]
    return {size: max(1, args.mib * MiB // size) for size in sizes}


def _l1_bytes(stored: int) -> int:
    """An L1 that holds ``stored`` bytes below the agent's low watermark: nothing evicted."""
    return math.ceil(stored / 0.75 / MiB) * MiB + 64 * MiB


def measure(
    sides: dict[str, Side], counts: dict[int, int], runs: int, pairs: dict[str, PeerPair]
) -> Results:
    results = Results()
    names = list(sides)
    for number in range(runs + 1):  # run 0: the warm-up
        turn = number % len(names)
        for size, count in counts.items():
            for name in names[turn:] + names[:turn]:
                side = sides[name]
                before = [_cpu_seconds(pid) for pid in side.pids]
                seconds = side.transfer(size, count)
                if number:
                    results.seconds.setdefault((name, size), []).append(seconds)
                    cpu = results.cpu.setdefault((name, size), [0.0, 0.0])
                    for index, pid in enumerate(side.pids):
                        cpu[index] += _cpu_seconds(pid) - before[index]
                if name in pairs:
                    results.intact = results.intact and pairs[name].pulled_intact(size, count)
    return results


def _cpu_seconds(pid: int) -> float:
    """The user and system CPU seconds process ``pid`` has used (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(results: Results, args: argparse.Namespace, counts: dict[int, int], mtu: str) -> str:
    protections = [] if args.skip_peer else list(args.wire)
    rows = []
    for size, count in counts.items():
        moved = size * count
        plain = [moved / seconds / 1e9 for seconds in results.seconds[(SOCKET, size)]]
        cpu = _cpu_per_gb(results.cpu[(SOCKET, size)], moved * len(plain))
        rows.append([chunk_label(size), str(count), SOCKET, median_spread(plain, "{:.2f}")])
        rows[-1] += [cpu, "", ""]
        if (peer_nixl.NAME, size) in results.seconds:
            raw = [moved / seconds / 1e9 for seconds in results.seconds[(peer_nixl.NAME, size)]]
            ratios = [r / s for r, s in zip(raw, plain, strict=True)]
            cpu = _cpu_per_gb(results.cpu[(peer_nixl.NAME, size)], moved * len(raw))
            rows.append(["", "", peer_nixl.NAME, median_spread(raw, "{:.2f}"), cpu])
            rows[-1] += [median_spread(ratios, "{:.2f}"), ""]
        for protection in protections:
            name = side_name(protection)
            pulled = [moved / seconds / 1e9 for seconds in results.seconds[(name, size)]]
            ratios = [p / s for p, s in zip(pulled, plain, strict=True)]
            bound = GOALS[protection]
            target = goal(f">= {bound}", statistics.median(ratios), bound, at_least=True)
            cpu = _cpu_per_gb(results.cpu[(name, size)], moved * len(pulled))
            rows.append(["", "", name, median_spread(pulled, "{:.2f}"), cpu])
            rows[-1] += [median_spread(ratios, "{:.2f}"), target if size >= GOAL_FROM else ""]
    header = ["chunk", "chunks", "side", "GB/s", "CPU s/GB A / B", "/ socket", "goal"]
    title = (
        f"Host A -> host B over veth (MTU {mtu}) through a bridge, {args.mib} MiB of chunks "
        f"per transfer; {runs_said(args.runs)}: GB/s median [min-max], ratio to the plain "
        "socket per run; CPU: seconds of the process on A and on B (the sender and the "
        "receiver; the agents) per GB moved, all runs"
    )
    lines = [table(title, header, rows)]
    lines += [f"{side}: not measured: {why}" for side, why in results.unmeasured.items()]
    if protections:
        lines += _checks(results, counts, protections)
    return "\n".join(lines)


def _cpu_per_gb(cpu: list[float], moved: int) -> str:
    """``A / B``: each side's CPU seconds per GB of ``moved`` bytes."""
    return " / ".join(f"{seconds / moved * 1e9:.2f}" for seconds in cpu)


def _checks(results: Results, counts: dict[int, int], protections: Sequence[str]) -> list[str]:
    """What the table should show, said in words: yes, or NO where it does not."""

    def said(claim: str, holds: bool) -> str:
        return f"{claim}: {'yes' if holds else 'NO'}"

    def meets(protection: str) -> bool:
        return all(
            statistics.median(
                plain / pulled  # seconds: the ratio of GB/s the other way round
                for plain, pulled in zip(
                    results.seconds[(SOCKET, size)],
                    results.seconds[(side_name(protection), size)],
                    strict=True,
                )
            )
            >= GOALS[protection]
            for size in counts
            if size >= GOAL_FROM
        )

    lines = [said("every chunk B pulled was A's, byte for byte", results.intact)]
    for protection in protections:
        claim = (
            f"{side_name(protection)} >= {GOALS[protection]} x plain socket (median ratio), "
            f"chunks from {GOAL_FROM // MiB} MiB"
        )
        lines.append(said(claim, meets(protection)))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    summary = "chunks pulled from another node's agent vs a plain socket over the same link"
    arguments = sys.argv[1:] if argv is None else argv
    return reports.main(PROGRAM, summary, add_arguments, run, arguments)


if __name__ == "__main__":
    sys.exit(main())
