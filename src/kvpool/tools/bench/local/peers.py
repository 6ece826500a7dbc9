"""Agents that are each other's peers: the pool's peer credential and each agent's
settings, as the operator writes them (a Secret of one key; ``PEERS__*``)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvpool.tools.bench.local.agent_process import AgentProcess
from kvpool.tools.bench.local.hosts import Host


def write_peer_key(directory: Path, material: str | None = None) -> Path:
    """A peer credential of one key (``material``, or a random one) in a new ``directory``."""
    directory.mkdir(parents=True)
    key = directory / "1"
    key.write_text(material or secrets.token_hex(32))
    key.chmod(0o600)
    return directory


def peer_settings(
    node: str, port: int, key_dir: Path, peers: Iterable[str], **more: str
) -> dict[str, str]:
    """An agent named ``node`` that serves its peers on ``port`` with the credential in
    ``key_dir``; ``peers`` (``name=ip:port`` each) are those it fetches from."""
    return {
        "PEERS__PORT": str(port),
        "PEERS__KEY_DIR": str(key_dir),
        "PEERS__NODE": node,
        "PEERS__AGENTS": json.dumps(list(peers)),
        **more,
    }


TRANSPORTS = ("tcp", "nixl")
LINK_ENVIRONMENT = {"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n", "NIXL_LOG_LEVEL": "WARN"}
"""The environment of a process on a host of these (network namespaces of one machine):
NIXL's UCX held to TCP, the link between the hosts (they could otherwise share memory,
which is not the link), and NIXL's warnings only."""


def host_agents(
    work: Path, hosts: Sequence[Host], port: int, transport: str = "tcp"
) -> list[AgentProcess]:
    """One agent per host (not started), ``host-<i>``, each with every host as a peer on
    ``port`` over ``transport``, sharing a new credential in ``work``."""
    key_dir = write_peer_key(work / "pool-key")
    entries = [f"host-{i}={host.address}:{port}" for i, host in enumerate(hosts)]
    agents = []
    for index, host in enumerate(hosts):
        workdir = work / f"agent-{index}"
        workdir.mkdir()
        settings = peer_settings(
            f"host-{index}", port, key_dir, entries, PEERS__TRANSPORT=transport
        )
        agents.append(AgentProcess(workdir, settings, host=host, environment=LINK_ENVIRONMENT))
    return agents
