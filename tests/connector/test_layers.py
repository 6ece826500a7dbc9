"""The connector runs inside vLLM and reaches the agent only through the client library.

Loading the agent's cache, allocator, journal, policies, service or servers there
would cost vLLM's processes memory and start-up time for code they never run, and
would tie the connector to the agent's internals. A fresh interpreter imports every
connector module and reports what it loaded.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

from kvpool import connector

pytestmark = pytest.mark.process

AGENT_INTERNALS = (
    "kvpool.agent.core.l1",
    "kvpool.agent.core.allocator",
    "kvpool.agent.core.journal",
    "kvpool.agent.core.policies",
    "kvpool.agent.service.cache_service",
    "kvpool.agent.edge.zmq_server",
    "kvpool.agent.server",
)

_REPORT_LOADED = (
    "import importlib, sys\n"
    "for name in sys.argv[1:]:\n"
    "    importlib.import_module(name)\n"
    "print('\\n'.join(sorted(sys.modules)))\n"
)


def test_the_connector_loads_none_of_the_agents_internals() -> None:
    modules = [
        f"{connector.__name__}.{info.name}" for info in pkgutil.iter_modules(connector.__path__)
    ]
    assert f"{connector.__name__}.facade" in modules

    result = subprocess.run(
        [sys.executable, "-c", _REPORT_LOADED, *modules],
        capture_output=True,
        text=True,
        check=True,
    )

    loaded = result.stdout.split()
    assert set(modules) <= set(loaded)
    assert [
        name
        for name in loaded
        if any(name == internal or name.startswith(f"{internal}.") for internal in AGENT_INTERNALS)
    ] == []
