"""Fixtures of the peer tier's tests: hosts (network namespaces) on this machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.tools.bench.local.hosts import Hosts
from tests.support.hosts import hosts_or_skip


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Two hosts on one bridge, or the test skipped with the reason this machine has none."""
    with hosts_or_skip(2) as made:
        yield made
