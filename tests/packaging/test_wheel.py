"""What the wheel ships: kvpool's packages, and no test harness. The tests' agent extras,
the hosts in network namespaces (root only) and the peer bench stay in the repository
(``tests/support``, ``benchmarks/``)."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # pip builds the wheel

TEST_ONLY = re.compile(
    r"netns|veth|harness|pytest|^\s*(?:from|import) (?:tests|benchmarks)\b", re.MULTILINE
)
"""What no shipped file says: network namespaces and their cables, a test harness, a test
runner, an import of the repository's tests or benchmarks."""


def test_the_wheel_holds_kvpool_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"kvpool", "kvpool_agent"}


def test_the_wheel_ships_no_test_harness_and_no_network_namespaces(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        files = {name: archive.read(name).decode() for name in archive.namelist()}
    sources = [name for name in files if name.endswith(".py")]
    assert "kvpool/tools/bench/local/agent_process.py" in sources  # what the benches start
    found = {name: match.group() for name in sources if (match := TEST_ONLY.search(files[name]))}
    assert found == {}
