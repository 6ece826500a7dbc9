"""``kvpool bench l2`` runs end to end (tiny sizes, its own moto server) and prints its tables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

BIN = Path(sys.executable).parent
NUMBER = r"\d+\.\d+"


def rows_of(output: str, title: str) -> dict[str, list[str]]:
    """The rows of the table whose title starts with ``title``, by "chunk op"."""
    (block,) = [block for block in output.split("\n\n") if block.startswith(title)]
    rows = [re.split(r" {2,}", line.strip()) for line in block.splitlines()[3:]]
    return {f"{row[0]} {row[1]}": row for row in rows}


def test_bench_l2_prints_sealed_against_plaintext_with_the_cpu_per_gb(tmp_path: Path) -> None:
    command = [
        str(BIN / "kvpool"),
        "bench",
        "l2",
        *("--chunk-mib", "1", "--group-mib", "1", "--repeats", "1", "--concurrency", "2"),
        *("--codec-mib", "2", "--nvme-mib", "2", "--s3-mib", "2", "--nvme-dir", str(tmp_path)),
    ]
    output = subprocess.run(command, capture_output=True, text=True, timeout=180, check=True).stdout
    sealing = (
        ("ObjectCodec on one core", ("encode", "open"), ""),
        (
            "NVMe adapter sealed (AES-GCM) vs plaintext (GMAC), same run",
            ("write", "read"),
            ">= 0.8",
        ),
        ("S3 adapter sealed (AES-GCM) vs plaintext (GMAC)", ("put", "get"), ">= 0.8"),
    )
    for title, operations, goal in sealing:
        rows = rows_of(output, title)
        assert sorted(rows) == sorted(f"1 MiB {op}" for op in operations), output
        for row in rows.values():
            *speeds, ratio = row[2:5]
            assert all(re.fullmatch(f"{NUMBER} GB/s", speed) for speed in speeds), row
            assert re.fullmatch(NUMBER, ratio), row
            # an empty goal cell splits away; a goal this machine missed is marked
            assert row[5:-2] in (([goal], [f"{goal} MISSED"]) if goal else ([],)), row
            assert all(re.fullmatch(NUMBER, cpu) for cpu in row[-2:]), row  # CPU s/GB, each side
    for title in (
        "NVMe adapter (plaintext, its default) vs raw files",
        "S3 adapter (sealed, its default) vs raw boto3",
    ):
        assert len(rows_of(output, title)) == 2, output
