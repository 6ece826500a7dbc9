"""Hosts (network namespaces) for a test, or the test skipped with the reason there are none."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvpool.tools.bench.harness.hosts import Hosts, HostsUnavailable


@contextlib.contextmanager
def hosts_or_skip(count: int) -> Iterator[Hosts]:
    """``count`` started hosts, closed on exit (also on an error or an interrupt)."""
    try:
        made = Hosts(count).start()
    except HostsUnavailable as error:
        pytest.skip(f"no hosts on this machine: {error}")
    with made:
        yield made
