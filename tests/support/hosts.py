"""Hosts in network namespaces for a test (:mod:`kvpool.tools.bench.local.hosts`), or the
test skipped where this machine can make none."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvpool.tools.bench.local.hosts import Host, Hosts, HostsUnavailable

__all__ = ["Host", "Hosts", "HostsUnavailable", "hosts_or_skip"]


@contextlib.contextmanager
def hosts_or_skip(count: int) -> Iterator[Hosts]:
    """``count`` started hosts for a test, closed on exit (also on an error or an
    interrupt), or the test skipped with the reason this machine has none."""
    try:
        made = Hosts(count).start()
    except HostsUnavailable as error:
        pytest.skip(f"no hosts on this machine: {error}")
    with made:
        yield made
