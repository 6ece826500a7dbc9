"""``kvpool bench index`` runs end to end (small sizes) and prints its tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

BIN = Path(sys.executable).parent


def test_bench_index_prints_query_memory_and_event_figures() -> None:
    command = [
        str(BIN / "kvpool"),
        "bench",
        "index",
        *("--chunks", "20000", "--nodes", "4", "--prompt-tokens", "1024"),
        *("--queries", "50", "--publishers", "2", "--events", "2000"),
    ]
    output = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "Prefix index: 20,0" in output
    for row in ("route, whole prompt cached", "memory per tracked chunk", "queues draining"):
        assert row in output
    assert "all applied" in output
    assert "gaps seen (lost events, each a resync)" in output
