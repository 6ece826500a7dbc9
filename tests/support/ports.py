"""Loopback ports for the servers a test starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nobody listens on now (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
