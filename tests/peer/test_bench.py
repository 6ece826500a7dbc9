"""``kvpool bench peer``: its smallest run between two hosts prints the table, and its report's
rates, ratios and checks on made-up seconds."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from kvpool_agent.bench.peer import PEER, SOCKET, MiB, Results, report
from tests.support.hosts import hosts_or_skip

BIN = Path(sys.executable).parent


def rows_of(output: str) -> list[list[str]]:
    """The table's rows (a chunk size first), split on runs of two spaces or more."""
    rows = [line for line in output.splitlines() if re.match(r" *\d+ MiB  ", line)]
    return [re.split(r" {2,}", line.strip()) for line in rows]


def test_the_smallest_run_pulls_through_the_peer_and_measures_the_link() -> None:
    with hosts_or_skip(1):  # this machine can make hosts
        pass
    command = [str(BIN / "kvpool"), "bench", "peer", "--chunk-mib", "1,2", "--mib", "4"]
    command += ["--runs", "2"]
    output = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout

    rows = rows_of(output)
    assert [row[:2] for row in rows] == [["1 MiB", "4"], ["2 MiB", "2"]], output
    figures = r"\d+\.\d\d \[\d+\.\d\d-\d+\.\d\d\]"
    for row in rows:
        assert all(re.fullmatch(figures, cell) for cell in row[2:5]), row
    assert rows[1][5] == ">= 0.8"
    assert "over veth (MTU " in output
    assert "every chunk B pulled was A's, byte for byte: yes" in output
    assert "command: kvpool bench peer --chunk-mib 1,2 --mib 4 --runs 2\n" in output
    assert "CPU: " in output


def test_report_rates_ratios_per_run_and_the_goal() -> None:
    args = argparse.Namespace(chunk_mib=[1, 2], mib=4, runs=2, skip_peer=False)
    counts = {MiB: 4, 2 * MiB: 2}
    moved = 4 * MiB
    results = Results(
        seconds={
            (SOCKET, MiB): [moved / 2e9, moved / 4e9],  # 2 and 4 GB/s
            (PEER, MiB): [moved / 1e9, moved / 1e9],  # ratios 0.5 and 0.25
            (SOCKET, 2 * MiB): [moved / 2e9, moved / 2e9],
            (PEER, 2 * MiB): [moved / 1.8e9, moved / 1.6e9],  # ratios 0.9 and 0.8
        }
    )
    text = report(results, args, counts, "1500")
    rows = rows_of(text)

    # chunk, chunks, plain socket GB/s, peer GB/s, peer / socket, goal
    assert rows[0] == ["1 MiB", "4", "3.00 [2.00-4.00]", "1.00 [1.00-1.00]", "0.38 [0.25-0.50]"]
    peer = ["1.70 [1.60-1.80]", "0.85 [0.80-0.90]", ">= 0.8"]  # the goal from 2 MiB on
    assert rows[1] == ["2 MiB", "2", "2.00 [2.00-2.00]", *peer]
    assert "every chunk B pulled was A's, byte for byte: yes" in text
    assert "peer >= 0.8 x plain socket (median ratio), chunks from 2 MiB: yes" in text

    slower = Results(seconds={**results.seconds, (PEER, 2 * MiB): [moved / 1e9] * 2}, intact=False)
    text = report(slower, args, counts, "1500")
    assert "byte for byte: NO" in text
    assert "chunks from 2 MiB: NO" in text


def test_report_without_the_peer_has_the_link_alone() -> None:
    args = argparse.Namespace(chunk_mib=[2], mib=4, runs=1, skip_peer=True)
    text = report(Results(seconds={(SOCKET, 2 * MiB): [4 * MiB / 2e9]}), args, {2 * MiB: 2}, "1500")

    assert rows_of(text) == [["2 MiB", "2", "2.00"]]
    assert "peer" not in text
