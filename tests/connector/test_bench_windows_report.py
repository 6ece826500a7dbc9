"""``kvpool bench windows``'s report: bytes per chunk of the mix against the all-full model,
the connector's log line, TTFT with its spread across runs and paired ratios (no engine:
made-up samples); its flags are range-checked."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvpool.common.problems import ArgumentParser
from kvpool.tools.bench.connector import Run
from kvpool.tools.bench.connector_engine import Sample
from kvpool.tools.bench.windows import Logged, Stored, add_arguments, layer_types, read_log, report

ARGS = argparse.Namespace(
    layers=8,
    full_every=2,
    hidden=512,
    kv_heads=4,
    window=128,
    chunk_tokens=256,
    prompt_tokens=2049,
    requests=2,
)
SECONDS = {"kvpool": 0.030, "none": 0.300, "native": 0.020}
CACHED = {"kvpool": 2048, "none": 0, "native": 2048}
# 256 tokens x 4 KV heads x 64 x K,V x 2 bytes = 256 KiB per layer and chunk; a sliding
# layer keeps 1 of the 2 blocks
FULL_CHUNK = 8 * 256 * 1024
MIX_CHUNK = 4 * 256 * 1024 + 4 * 128 * 1024


def make_run(scale: float) -> Run:
    run = Run()
    for config, seconds in SECONDS.items():
        run.repeated[config] = [
            Sample(seconds * scale, CACHED[config], token=7, connector_us={}) for _ in range(2)
        ]
    return run


def row(text: str, table: str, name: str) -> list[str]:
    """The cells of row ``name`` in the table whose title starts with ``table``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(table))
    return next(line.split() for line in lines[start:] if line.strip().startswith(name + "  "))


def test_bytes_per_chunk_of_the_mix_against_every_layer_full() -> None:
    groups = "window127: 4 layers, 1 of 2 blocks; full: 4 layers, 2 of 2 blocks"
    stored = {
        "mix": Stored(72, 72 * MIX_CHUNK, Logged(groups, MIX_CHUNK, 256)),
        "full": Stored(72, 72 * FULL_CHUNK, None),
    }
    runs = {"mix": [make_run(1.0)], "full": [make_run(1.0)]}
    text = report(runs, stored, ARGS)

    # model, sliding + full, chunks, bytes/chunk, connector log, vs full
    mix = ["mix", *("4", "+", "4"), "72", "1,572,864", "1,572,864", "0.750"]
    assert row(text, "Bytes stored", "mix") == mix
    full = ["full", *("0", "+", "8"), "72", "2,097,152", "n/a", "1.000"]
    assert row(text, "Bytes stored", "full") == full
    assert f"mix groups (connector log): {groups}" in text


def test_ttft_of_a_kvpool_hit_against_recompute_and_native_with_the_spread_of_runs() -> None:
    stored = {"mix": Stored(8, 8 * MIX_CHUNK), "full": Stored(8, 8 * FULL_CHUNK)}
    runs = {
        "mix": [make_run(1.0), make_run(1.2), make_run(1.1)],
        "full": [make_run(1.0)],
    }
    text = report(runs, stored, ARGS)

    assert "median [min-max] of 3 runs" in text
    assert row(text, "Reader TTFT", "mix") == [
        "mix",
        *("33.0", "[30.0-36.0]"),  # kvpool hit
        *("330.0", "[300.0-360.0]"),  # recompute
        *("22.0", "[20.0-24.0]"),  # native hit
        *("0.100", "[0.100-0.100]"),  # kvpool / recompute, paired per round
        *("1.50", "[1.50-1.50]"),  # kvpool / native
        *("2048", "/", "2048"),
    ]
    assert "mix: first tokens identical across configs: yes" in text
    assert "NO hits" not in text

    for one in runs["full"]:  # a kvpool engine that never reached its agent
        one.repeated["kvpool"] = [Sample(0.3, 0, 7, {}) for _ in range(2)]
    assert "full: the kvpool engine got NO hits" in report(runs, stored, ARGS)


def test_the_connectors_log_line_and_the_layer_kinds(tmp_path: Path) -> None:
    log = tmp_path / "kvpool.log"
    log.write_text(
        "INFO 01-01 worker.py:137] kvpool worker 0: window127: 4 layers, 1 of 2 blocks "
        "(128, 4, 64) (HND); full: 4 layers, 2 of 2 blocks (128, 4, 64) (HND), "
        "1572864 bytes per 256-token chunk\n"
    )
    logged = read_log(log)
    assert logged is not None
    assert (logged.chunk_bytes, logged.chunk_tokens) == (1572864, 256)
    assert logged.groups.startswith("window127: 4 layers")
    assert read_log(tmp_path / "missing.log") is None

    assert layer_types("mix", ARGS) == ["sliding_attention", "full_attention"] * 4
    assert layer_types("full", ARGS) == ["full_attention"] * 8


@pytest.mark.parametrize(
    ("flag", "value"), [("--window", "0"), ("--runs", "-1"), ("--full-every", "1")]
)
def test_flags_out_of_range_are_refused(flag: str, value: str) -> None:
    parser = ArgumentParser(prog="kvpool bench windows")
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([flag, value])
