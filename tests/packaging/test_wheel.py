"""What the wheel ships: kvpool's packages, and no test harness. The tests' agent extras and
the peer bench stay in the repository (``tests/support``, ``benchmarks/``). Network
namespaces are made by one shipped module, the hosts of ``kvpool bench cluster``
(:mod:`kvpool.tools.bench.local.hosts`, root only), which no component imports (the import
contracts say so)."""

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
HOSTS = "kvpool/tools/bench/local/hosts.py"
"""The one shipped file that makes network namespaces: ``kvpool bench cluster``'s hosts."""


def test_the_wheel_holds_kvpool_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"kvpool", "kvpool_agent"}


def test_the_wheel_ships_no_test_harness_and_namespaces_only_for_the_cluster_bench(
    wheel: Path,
) -> None:
    with zipfile.ZipFile(wheel) as archive:
        files = {name: archive.read(name).decode() for name in archive.namelist()}
    sources = [name for name in files if name.endswith(".py")]
    assert "kvpool/tools/bench/local/agent_process.py" in sources  # what the benches start
    assert HOSTS in sources
    found = {name: match.group() for name in sources if (match := TEST_ONLY.search(files[name]))}
    assert set(found) == {HOSTS}
    assert "pytest" not in files[HOSTS] and "harness" not in files[HOSTS]
