"""``kvpool bench spaces``: its smallest run on the real engine (a shared space stores less
than plain salts, and its reader loads the system prompt from the pool, not from vLLM's own
cache), and its report's layout and ratios on made-up samples."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.common.keys import plan_salt
from kvpool.common.problems import ArgumentParser
from kvpool.tools.bench.connector_engine import Sample
from kvpool.tools.bench.spaces import MIB, Results, Round, add_arguments, report, salt
from tests.support.engines import needs_fast_bf16

BIN = Path(sys.executable).parent
MODES = ["plain salts", "shared space", "no salt"]


def rows_of(output: str) -> list[list[str]]:
    """The table's rows, split on runs of two spaces or more."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mode  ")) + 2
    end = next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith("recompute"))
    return [re.split(r" {2,}", line.strip()) for line in lines[start : end + 1]]


@pytest.mark.process
@pytest.mark.engine
@needs_fast_bf16
def test_the_smallest_run_shares_the_system_prompt_through_the_pool() -> None:
    command = [
        *(str(BIN / "kvpool"), "bench", "spaces", "--tenants", "2", "--layers", "2"),
        *("--system-tokens", "512", "--runs", "1", "--recompute", "1"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=True)

    rows = rows_of(result.stdout)
    assert [row[:2] for row in rows] == [*([mode, "2"] for mode in MODES), ["recompute", "1"]]
    by_mode = {row[0]: row for row in rows[:3]}
    stored = {mode: float(row[7]) for mode, row in by_mode.items()}
    # 512 + 256 tokens: 3 chunks each with plain salts, the space's 2 and a question each
    assert stored["shared space"] < stored["plain salts"]
    assert float(by_mode["plain salts"][8]) == pytest.approx(6 / 4)
    own, pool = map(int, by_mode["shared space"][9].split(" / "))
    assert (own, pool) == (0, 512)
    assert by_mode["no salt"][9] == "512 / 0"  # vLLM's own cache, no isolation
    assert "every reader loaded the system prompt's 2 chunks from the pool: yes" in result.stdout
    assert "no reader hit vLLM's own prefix cache (other tenants' salts): yes" in result.stdout
    assert "command: kvpool bench spaces --tenants 2 --system-tokens 512" in result.stdout
    assert "--layers 2 " in result.stdout
    assert "CPU: " in result.stdout


def sample(seconds: float, cached: int = 0, hit_tokens: int = 0) -> Sample:
    return Sample(seconds, cached, token=7, connector_us={}, hit_tokens=hit_tokens)


def test_the_table_has_every_mode_for_each_tenant_count_then_recompute() -> None:
    args = argparse.Namespace(
        tenants=[1, 2],
        system_tokens=512,
        question_tokens=256,
        chunk_tokens=256,
        recompute=1,
        layers=8,
        hidden=512,
    )
    results = Results(
        rounds={
            (mode, n): [Round(sample(0.5), [sample(0.1, 512, 512)] * n, MIB)]
            for mode in ("plain", "space", "none")
            for n in (1, 2)
        },
        recompute=[[sample(0.5)]],
    )
    rows = rows_of(report(results, args))
    assert [row[:3] for row in rows] == [
        *([mode, n, n] for n in ("1", "2") for mode in MODES),
        ["recompute", "1", "500.0"],  # one request, no tenants
    ]


def test_report_ratios_to_recompute_no_salt_and_space() -> None:
    args = argparse.Namespace(
        tenants=[3],
        system_tokens=512,
        question_tokens=256,
        chunk_tokens=256,
        recompute=2,
        layers=8,
        hidden=512,
    )
    writer = sample(0.5)
    results = Results(
        rounds={
            ("plain", 3): [Round(writer, [sample(0.5), sample(0.7)], 9 * 2 * MIB)],
            ("space", 3): [Round(writer, [sample(0.1, 512, 512), sample(0.1, 512, 512)], 10 * MIB)],
            ("none", 3): [Round(writer, [sample(0.05, 512), sample(0.05, 512)], 10 * MIB)],
        },
        recompute=[[sample(0.5), sample(0.5)]],
    )
    rows = [re.split(r" {2,}", line.strip()) for line in report(results, args).splitlines()[3:7]]

    # mode, tenants, readers, reader TTFT [min-max], vs recompute, vs no salt, writer TTFT,
    # stored MiB, vs space, cached tokens vLLM / pool
    plain = ["plain salts", "3", "2", "600.0 [500.0-700.0]", "1.200", "12.00", "500.0", "18.0"]
    assert rows[0] == [*plain, "1.80", "0 / 0"]
    space = ["shared space", "3", "2", "100.0 [100.0-100.0]", "0.200", "2.00", "500.0", "10.0"]
    assert rows[1] == [*space, "1.00", "0 / 512"]
    assert rows[2][-1] == "512 / 0"
    assert rows[3] == ["recompute", "2", "500.0 [500.0-500.0]"]  # no tenants, no ratios


def test_the_salts_of_each_mode_and_the_flags() -> None:
    plan = plan_salt(salt("space", 3, 4096))
    assert (plan.space_salt, plan.shared_tokens, plan.tenant_salt) == (
        "bench-space",
        4096,
        "bench-tenant-3",
    )
    assert salt("plain", 3, 4096) == "bench-tenant-3"
    assert salt("none", 3, 4096) is None

    parser = ArgumentParser(prog="kvpool bench spaces")
    add_arguments(parser)
    assert parser.parse_args(["--tenants", "1,8,64"]).tenants == [1, 8, 64]
    assert parser.parse_args(["--tenants", "8,1,8"]).tenants == [8, 1]
    with pytest.raises(SystemExit):
        parser.parse_args(["--tenants", "0,8"])
