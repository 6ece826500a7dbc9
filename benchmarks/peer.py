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
  (UCX held to TCP; its agent configured as kvpool's agents configure theirs) writing the
  same chunks from A into B with no kvpool code, one NIXL request per transfer
  (:mod:`benchmarks.peer_nixl`): the engine's raw rate over this link;
* peer, for each transport of ``--transport`` (``tcp``; ``nixl``: the frames on the peer
  port, the bodies written by NIXL into a landing of B's; ``peers.transport``) and each wire
  protection of ``--wire`` (``sealed``: AEGIS-128L ciphertext; ``integrity``: the
  plaintext under its tag; ``peers.wire_protection``): agent A holds the chunks in its L1;
  agent B, whose only lower tier is A, pulls them on a lookup with prefetch, timed until
  every chunk is loaded into its L1 (:mod:`benchmarks.peer_agents`; one pair of agents per
  transport and protection, on peer ports of their own). Every pull is then checked byte
  for byte (untimed). ``--skip-peer`` measures the link alone.

Each of ``--runs`` runs moves every size once on each side, the side that goes first
turning with the run, after one untimed warm-up run (connections, page faults). Figures:
GB/s of each run, median [min-max]; the ratios are a side over the plain socket, and over
its transport's raw rate (the plain socket for tcp, NIXL raw for nixl), within one run.
Goals: from 2 MiB chunks on, sealed >= 0.8 of the plain socket and integrity >= 0.9 of the
raw rate (the link's rate with the cipher's pass gone); below 2 MiB, >= 0.6 of the raw
rate.

Where both hosts share a few cores, a side that seals or tags every chunk cannot reach
those: the passes over each chunk take CPU from the link's share. So each peer side is also
given over its *bound*: the least of its transport's raw rate and the GB/s at which the
machine's cores, all busy, do the raw side's work per GB (its CPU on A and B) and the
passes its protection needs, each measured alone (:mod:`benchmarks.peer_passes`). NIXL
raw's sender looks at its write without pause, so the nixl sides' bound counts the
engine's CPU at its most.

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

from benchmarks import peer_nixl, peer_passes, peer_ttft
from benchmarks.peer_agents import PeerPair, peer_pair
from benchmarks.peer_socket import plain_link
from kvpool.common import problems
from kvpool.common.names import DEFAULT_PEER_PORT
from kvpool.tools.bench import cpu_features
from kvpool.tools.bench import report as reports
from kvpool.tools.bench.local.hosts import Hosts, HostsUnavailable
from kvpool.tools.bench.local.peers import TRANSPORTS
from kvpool.tools.bench.report import (
    add_chunk_mib,
    chunk_bytes,
    chunk_label,
    command,
    machine,
    median_spread,
    runs_said,
    table,
)

PROGRAM = "python -m benchmarks.peer"

MiB = 1 << 20
SOCKET = "plain socket"
PROTECTIONS = ("sealed", "integrity")
GOAL_FROM = 2 * MiB
"""Chunks this large and up are held to a protection's goal; smaller ones to SMALL_GOAL."""
GOALS = {"sealed": (SOCKET, 0.8), "integrity": ("raw", 0.9)}
"""Per protection, for chunks of GOAL_FROM bytes and up: at least this share of the plain
socket's GB/s, or of the transport's raw rate."""
SMALL_GOAL = ("raw", 0.6)


def side_name(transport: str, protection: str) -> str:
    return f"peer {transport}, {protection}"


def raw_side(transport: str) -> str:
    """The side whose rate is the transport's raw rate over the link."""
    return SOCKET if transport == "tcp" else peer_nixl.NAME


def goal_of(protection: str, size: int) -> tuple[str, float]:
    """``(reference, share)``: a side of ``protection`` moving chunks of ``size`` bytes
    moves at least ``share`` of ``reference``'s GB/s (``raw``: its transport's)."""
    return GOALS[protection] if size >= GOAL_FROM else SMALL_GOAL


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
        type=_some_of(PROTECTIONS),
        default=list(PROTECTIONS),
        help="the agents' wire protections, each a side of its own (default: sealed,integrity)",
    )
    parser.add_argument(
        "--transport",
        type=_some_of(TRANSPORTS),
        default=list(TRANSPORTS),
        help="the agents' peer transports, each with every protection (default: tcp,nixl)",
    )
    peer_ttft.add_arguments(parser)
    cpu_features.add_as_avx2(parser)


def _some_of(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A parser of a comma-separated list of ``choices``."""

    def parse(text: str) -> list[str]:
        chosen = [item.strip() for item in text.split(",")]
        wrong = [item for item in chosen if item not in choices]
        if wrong or not chosen:
            raise argparse.ArgumentTypeError(f"expected some of {','.join(choices)}, not {text!r}")
        return list(dict.fromkeys(chosen))

    return parse


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
    passes: dict[int, peer_passes.Passes] = field(default_factory=dict)
    """Per chunk size, the CPU each pass over a chunk costs, measured alone."""

    def ratios(self, side: str, reference: str, size: int) -> list[float]:
        """``side``'s GB/s over ``reference``'s moving chunks of ``size``, run by run (the
        same bytes: the ratio of their seconds the other way round)."""
        pairs = zip(self.seconds[(reference, size)], self.seconds[(side, size)], strict=True)
        return [theirs / ours for theirs, ours in pairs]

    def rates(self, side: str, size: int, count: int) -> list[float]:
        """``side``'s GB/s moving chunks of ``size``, run by run."""
        return [size * count / seconds / 1e9 for seconds in self.seconds[(side, size)]]

    def carried(self, transport: str, protection: str, size: int, count: int) -> float:
        """The GB/s this machine's cores carry, all busy, for a peer side of ``transport``
        and ``protection``: both hosts share them, at the CPU per GB of the transport's raw
        side (A and B together, all runs) plus the passes over each chunk that the
        protection needs."""
        raw = raw_side(transport)
        moved = size * count * len(self.seconds[(raw, size)])
        per_gb = sum(self.cpu[(raw, size)]) / moved * 1e9
        per_gb += self.passes[size].per_gb(transport, protection)
        return _cores() / per_gb

    def bounds(self, transport: str, protection: str, size: int, count: int) -> list[float]:
        """A peer side's bound in GB/s, run by run: the least of its transport's raw rate in
        that run and what the cores carry (:meth:`carried`)."""
        carried = self.carried(transport, protection, size, count)
        return [min(raw, carried) for raw in self.rates(raw_side(transport), size, count)]

    def bound_ratios(self, transport: str, protection: str, size: int, count: int) -> list[float]:
        """The peer side's GB/s over its bound, run by run."""
        ours = self.rates(side_name(transport, protection), size, count)
        bounds = self.bounds(transport, protection, size, count)
        return [rate / bound for rate, bound in zip(ours, bounds, strict=True)]


def run(args: argparse.Namespace) -> None:
    cpu_features.take(args)
    try:
        hosts = Hosts(2).start()
    except HostsUnavailable as error:
        raise SystemExit(f"{PROGRAM} needs two hosts on this machine: {error}") from None
    counts = chunk_counts(args)
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
        for number, (transport, protection) in enumerate(_peer_sides(args)):
            name = side_name(transport, protection)
            if transport == "nixl" and missing is not None:
                unmeasured[name] = missing
                continue
            pair = stack.enter_context(
                peer_pair(
                    a,
                    b,
                    workdir / f"{transport}-{protection}",
                    holder_l1=l1_bytes(sum(size * count for size, count in counts.items())),
                    puller_l1=l1_bytes(largest),
                    port=DEFAULT_PEER_PORT + number,
                    wire_protection=protection,
                    transport=transport,
                )
            )
            for size, count in counts.items():
                pair.hold(size, count)
            pairs[name] = pair
            sides[name] = Side(pair.pull, pair.pids)
        results = measure(sides, counts, args.runs, pairs)
        results.unmeasured = unmeasured
        if pairs:
            results.passes = peer_passes.measure(list(counts))
        return results


def _peer_sides(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(transport, protection)`` of each peer side."""
    if args.skip_peer:
        return []
    return [(transport, protection) for transport in args.transport for protection in args.wire]


def chunk_counts(args: argparse.Namespace) -> dict[int, int]:
    """Chunks per transfer, by chunk size in bytes: ``--mib``'s worth, at least one."""
    sizes = [chunk_bytes(mib) for mib in args.chunk_mib]
    return {size: max(1, args.mib * MiB // size) for size in sizes}


def l1_bytes(stored: int) -> int:
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
    """The user and system CPU seconds process ``pid`` has used."""
    return sum(cpu_times(Path(f"/proc/{pid}/stat")))


def cpu_times(stat: Path) -> tuple[float, float]:
    """The user and the system CPU seconds in ``stat`` (``/proc/PID/stat``, or a thread's
    ``/proc/PID/task/TID/stat``)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def report(results: Results, args: argparse.Namespace, counts: dict[int, int], mtu: str) -> str:
    peers = [
        (transport, protection)
        for transport, protection in _peer_sides(args)
        if (side_name(transport, protection), next(iter(counts))) in results.seconds
    ]
    rows = []
    for size, count in counts.items():
        first = [chunk_label(size), str(count)]
        for name in [SOCKET, peer_nixl.NAME]:
            if (name, size) in results.seconds:
                ratio = "" if name == SOCKET else _spread(results.ratios(name, SOCKET, size))
                rows.append(
                    [*first, name, *_figures(results, name, size, count), ratio, "", "", ""]
                )
                first = ["", ""]
        for transport, protection in peers:
            name = side_name(transport, protection)
            reference, share = goal_of(protection, size)
            versus = {
                SOCKET: results.ratios(name, SOCKET, size),
                "raw": results.ratios(name, raw_side(transport), size),
            }
            met = statistics.median(versus[reference]) >= share
            target = f">= {share} {'socket' if reference == SOCKET else 'raw'}"
            rows.append(["", "", name, *_figures(results, name, size, count)])
            rows[-1] += [_spread(versus[SOCKET]), _spread(versus["raw"])]
            rows[-1] += [_spread(results.bound_ratios(transport, protection, size, count))]
            rows[-1] += [target + ("" if met else " MISSED")]
    header = ["chunk", "chunks", "side", "GB/s", "CPU s/GB A / B", "/ socket", "/ raw"]
    header += ["/ bound", "goal"]
    title = (
        f"Host A -> host B over veth (MTU {mtu}) through a bridge, {args.mib} MiB of chunks "
        f"per transfer; {runs_said(args.runs)}: GB/s median [min-max], ratios per run to the "
        "plain socket and to the transport's raw rate (tcp: the plain socket; nixl: NIXL raw); "
        "CPU: seconds of the process on A and on B (the sender and the receiver; the agents) "
        "per GB moved, all runs"
    )
    lines = [table(title, header, rows)]
    lines += [f"{side}: not measured: {why}" for side, why in results.unmeasured.items()]
    if peers:
        lines += _bounds(results, counts, peers)
        lines += _checks(results, counts, peers)
    return "\n".join(lines)


def _cores() -> int:
    """The cores this process (and so the agents it starts) may run on."""
    return len(os.sched_getaffinity(0))


def _bounds(
    results: Results, counts: dict[int, int], peers: Sequence[tuple[str, str]]
) -> list[str]:
    """What the bound of each peer side is made of, said in words."""
    cores = _cores()
    lines = [
        f"/ bound: over the least of the transport's raw rate in that run and what the {cores} "
        "cores both hosts share carry, all busy, at the raw side's CPU per GB plus the passes "
        "over each chunk its protection needs (sender: seal, or tag, on nixl copy and tag; "
        "receiver: open, or tag; nixl integrity: and the copy out of the landing), each "
        "measured alone on one thread (benchmarks/peer_passes.py), CPU s/GB:"
    ]
    for size, count in counts.items():
        passes = results.passes[size]
        carried = ", ".join(
            f"{transport} {protection} {results.carried(transport, protection, size, count):.2f}"
            for transport, protection in peers
        )
        lines.append(
            f"  {chunk_label(size)}: seal {passes.seal:.2f}, copy and tag {passes.copy_tag:.2f}, "
            f"open {passes.open_sealed:.2f}, tag {passes.check_tag:.2f}, copy {passes.copy:.2f}; "
            f"the cores carry (GB/s) {carried}"
        )
    return lines


def _spread(values: list[float]) -> str:
    return median_spread(values, "{:.2f}")


def _figures(results: Results, side: str, size: int, count: int) -> list[str]:
    """GB/s median [min-max], and CPU seconds per GB on A / on B, of all runs."""
    runs = results.seconds[(side, size)]
    moved = size * count
    cpu = " / ".join(
        f"{seconds / (moved * len(runs)) * 1e9:.2f}" for seconds in results.cpu[(side, size)]
    )
    return [_spread([moved / seconds / 1e9 for seconds in runs]), cpu]


def _checks(
    results: Results, counts: dict[int, int], peers: Sequence[tuple[str, str]]
) -> list[str]:
    """What the table should show, said in words: yes, or NO where it does not (and how much
    the bound allows there)."""
    lines = [f"every chunk B pulled was A's, byte for byte: {'yes' if results.intact else 'NO'}"]
    for transport, protection in peers:
        name = side_name(transport, protection)
        for small in (True, False):
            sizes = [size for size in counts if (size < GOAL_FROM) is small]
            if not sizes:
                continue
            reference, share = goal_of(protection, sizes[0])
            against = SOCKET if reference == SOCKET else raw_side(transport)
            missed = [
                size
                for size in sizes
                if statistics.median(results.ratios(name, against, size)) < share
            ]
            chunks = f"under {GOAL_FROM // MiB} MiB" if small else f"from {GOAL_FROM // MiB} MiB"
            claim = f"{name} >= {share} x {against} (median ratio), chunks {chunks}"
            if not missed:
                lines.append(f"{claim}: yes")
                continue
            allowed = min(
                statistics.median(
                    bound / rate
                    for bound, rate in zip(
                        results.bounds(transport, protection, size, counts[size]),
                        results.rates(against, size, counts[size]),
                        strict=True,
                    )
                )
                for size in missed
            )
            lines.append(f"{claim}: NO (its bound here is {allowed:.2f} x)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    summary = "chunks pulled from another node's agent vs a plain socket over the same link"
    arguments = sys.argv[1:] if argv is None else argv
    return reports.main(PROGRAM, summary, add_arguments, run, arguments)


if __name__ == "__main__":
    sys.exit(main())
