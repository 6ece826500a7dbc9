"""The wheel the packaging tests install and read, built once per run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "src")
"""What the package is built from (the Dockerfile copies the same)."""


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvpool's wheel, built once from a copy of what the Dockerfile copies (a build in the
    tree would leave build/ behind)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            shutil.copy(ROOT / name, source / name)
    clean = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", work, source],
        check=True,
        capture_output=True,
        env=clean,
    )
    (built,) = work.glob("kvpool-*.whl")
    return built
