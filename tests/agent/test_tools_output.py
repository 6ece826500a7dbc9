"""``kvpool bench ...`` and ``kvpool doctor``: ``--json`` (the result on standard output,
machine-readable), progress on standard error, missed goals marked, and help texts
without the markup of the docstrings they show."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool.common.problems import plain
from kvpool.tools import cli
from kvpool.tools.bench import report
from tests.support.mistakes import BIN

L1 = ["bench", "l1", "--chunks", "6400", "--lookups", "50", "--copy-mib", "32"]
"""A short ``kvpool bench l1`` (a second or so)."""


@pytest.mark.process
def test_bench_json_is_the_tables_and_progress_goes_to_stderr() -> None:
    run = subprocess.run(
        [BIN / "kvpool", *L1, "--json"], capture_output=True, text=True, timeout=300, check=True
    )
    result = json.loads(run.stdout)  # nothing else on standard output
    assert result["command"] == "kvpool " + " ".join([*L1, "--json"])
    index, copy = result["tables"]
    assert index["title"] == "L1 index, 6,400 chunks, policy lru"
    assert index["header"] == ["measure", "value", "goal"]
    assert index["rows"][0][0] == "prefix lookup with read lock, per chunk"
    assert index["rows"][0][2].startswith("<= 1 us")
    assert copy["header"][0] == "chunk" and len(copy["rows"]) == 3
    lines = run.stderr.splitlines()
    said = [line.split(" ", 1)[1] for line in lines if line[:2].isdigit()]  # HH:MM:SS ...
    assert said[:2] == [
        "kvpool bench l1: running; each table is printed when it is done",
        "index: filling 6,400 chunks",
    ]
    assert index["title"] in lines  # the text, as without --json, on standard error
    assert result["text"].startswith(index["title"])


@pytest.mark.process
def test_bench_without_json_prints_tables_on_stdout_and_progress_on_stderr() -> None:
    run = subprocess.run(
        [BIN / "kvpool", *L1], capture_output=True, text=True, timeout=300, check=True
    )
    assert run.stdout.startswith("L1 index, 6,400 chunks, policy lru\n")
    assert "index: timing 50 lookups of 64 chunks" in run.stderr
    assert "L1 index" not in run.stderr


def test_a_missed_goal_is_marked() -> None:
    assert report.goal("<= 1 us", 0.5, 1) == "<= 1 us"
    assert report.goal("<= 1 us", 1.5, 1) == "<= 1 us MISSED"
    assert report.goal(">= 0.8", 0.9, 0.8, at_least=True) == ">= 0.8"
    assert report.goal(">= 0.8", 0.7, 0.8, at_least=True) == ">= 0.8 MISSED"
    assert report.goal("<= 2%", (0.153 - 0.150) / 0.150, 0.02) == "<= 2%"  # 0.0200...04
    with report.recording() as tables:
        report.table("t", ["measure", "goal"], [["a", report.goal("<= 1", 2, 1)]])
    assert tables == [{"title": "t", "header": ["measure", "goal"], "rows": [["a", "<= 1 MISSED"]]}]


HELPS = [[], ["tenant-id"], ["doctor"], ["index"], ["bench"], *(["bench", b] for b in cli.BENCHES)]
LOADED = """
import sys
from kvpool.tools import cli
try:
    cli.main(["bench", "--help"])
finally:
    heavy = ("kvpool.tools.bench", "torch", "vllm", "boto3", "moto")
    print(sorted({m for m in sys.modules if m.split(".")[0] in heavy or m.startswith(heavy)}),
          file=sys.stderr)
"""
"""``kvpool bench --help`` in a fresh interpreter; then what it loaded of the benches and of
their heavy libraries, on standard error."""


@pytest.mark.process
def test_bench_help_lists_every_bench_and_loads_none() -> None:
    run = subprocess.run(
        [sys.executable, "-c", LOADED], capture_output=True, text=True, timeout=60, check=True
    )
    listed = run.stdout.split("positional arguments:")[1]
    for name, (summary, _) in cli.BENCHES.items():
        assert f"    {name} " in listed and summary.split()[0] in listed, name
    assert run.stderr.strip() == "[]"


@pytest.mark.parametrize("name", cli.BENCHES)
def test_each_bench_runs_its_own_module(name: str) -> None:
    _, load = cli.BENCHES[name]
    assert (load().__doc__ or "").startswith(f"``kvpool bench {name}``: ")


@pytest.mark.parametrize("command", HELPS, ids=lambda words: " ".join(["kvpool", *words]))
def test_help_shows_no_markup(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, "--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: kvpool")
    for markup in ("``", ":class:`", ":mod:`", ":func:`", ":meth:`", "::\n"):
        assert markup not in shown, markup


def test_plain() -> None:
    assert plain("``kvpool doctor``: see :class:`~kvpool.x.Check` and :mod:`json`") == (
        "kvpool doctor: see Check and json"
    )
    assert plain("as follows::\n\n    x\n") == "as follows:\n\n    x\n"
