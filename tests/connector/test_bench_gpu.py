"""``kvpool bench gpu``: on CPU caches here (the same copier, agent and protocol; its CUDA run
is in the closing notes), its refusal without CUDA, and its round-trip check."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpool.tools.bench.gpu_caches import ChunkCopies

pytestmark = pytest.mark.process

BIN = Path(sys.executable).parent


def rows_of(output: str, title: str) -> list[list[str]]:
    (block,) = [block for block in output.split("\n\n") if block.lstrip().startswith(title)]
    return [re.split(r" {2,}", line.strip()) for line in block.strip().splitlines()[3:]]


def test_bench_gpu_on_cpu_caches_prints_its_tables() -> None:
    command = [
        *(str(BIN / "kvpool"), "bench", "gpu", "--device", "cpu", "--models", "small-heads"),
        *("--chunk-tokens", "256", "--runs", "1", "--l1-size", "512Mi"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=True)

    (row,) = rows_of(result.stdout, "copies between GPU blocks and the agent's chunk files")
    assert row[:3] == ["small-heads", "256", "3.0"]
    rates = row[3:9] + row[10:]
    assert all(re.fullmatch(r"\d+\.\d+(/\d+\.\d+)?", cell) for cell in rates), row
    assert row[9] == "cpu"  # kvpool fused: no GPU, no fused copies
    shared = rows_of(result.stdout, "processes mapping one segment")
    assert [row[0] for row in shared] == ["1", "2"]
    assert len(shared[1][1].split(" + ")) == 2
    assert "maps no CUDA library (no CUDA context)" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_bench_gpu_without_cuda_says_so_in_one_line() -> None:
    result = subprocess.run(
        [str(BIN / "kvpool"), "bench", "gpu"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    started, refused = result.stderr.strip().splitlines()  # the progress line, then one line
    assert started.endswith(" kvpool bench gpu: running; each table is printed when it is done")
    assert refused == (
        "kvpool bench gpu needs a CUDA device (torch.cuda.is_available() is False); "
        "--device cpu runs the same copies on CPU caches"
    )


def test_the_round_trip_check_fails_on_one_changed_value() -> None:
    """The bench's proof that loads return what was stored can fail (a poisoned load)."""
    copies = ChunkCopies.make("small-heads", 256, 2, torch.device("cpu"), seed=3)
    for views in copies.caches.block_views:
        for view in views:
            for source, target in zip(copies.sources, copies.targets, strict=True):
                view[target] = view[source]
    copies.check("copied by hand")

    (views,) = copies.caches.block_views
    page = views[5][copies.targets[1][7]]
    page[1, 3, 0, 17] += 1.0
    with pytest.raises(SystemExit, match="layer 5 of the full group loaded other bytes"):
        copies.check("poisoned")
