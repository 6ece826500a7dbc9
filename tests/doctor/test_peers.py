"""``kvpool doctor``'s peers check against real agents on this machine (each its own peer
port on 127.0.0.1, its peers listed statically): every peer reached with the pool's
credential passes; each peer that is down or holds another credential is a WARN naming it
and why; an agent without peers, or that knows none, says so."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.tools.bench.local.peers import LINK_ENVIRONMENT, peer_settings, write_peer_key
from kvpool.tools.doctor import peers
from tests.support.agent_process import AgentProcess
from tests.support.ports import free_port

from .conftest import ADMIN_ENV, agent_args, run_doctor

pytestmark = pytest.mark.process

Start = Callable[..., AgentProcess]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    """``start(node, port, key_dir, peers)``: an agent named ``node`` serving its peers on
    ``port`` with the credential in ``key_dir``, ``peers`` (node: port) its peers
    (``environment``: more of its environment)."""
    started: list[AgentProcess] = []

    def run(
        node: str,
        port: int,
        key_dir: Path,
        others: dict[str, int],
        environment: dict[str, str] | None = None,
        **more: str,
    ) -> AgentProcess:
        workdir = tmp_path / node
        workdir.mkdir()
        entries = [f"{name}=127.0.0.1:{peer_port}" for name, peer_port in others.items()]
        settings = peer_settings(
            node,
            port,
            key_dir,
            entries,
            PEERS__CONNECT_TIMEOUT_SECONDS="1",
            PEERS__IO_TIMEOUT_SECONDS="2",
            **more,
        )
        agent = AgentProcess(
            workdir, settings, environment={**LINK_ENVIRONMENT, **(environment or {})}
        )
        started.append(agent)
        return agent.start()

    yield run
    for agent in started:
        agent.cleanup()


NO_NIXL = {"NIXL_PLUGIN_DIR": "/nonexistent"}
"""An environment where NIXL cannot start: no plugin."""


@pytest.mark.parametrize(
    "case",
    [
        ("sealed", "tcp", {}, "bodies over tcp", "tcp"),
        ("integrity", "nixl", {}, "bodies over nixl", "nixl"),
        ("sealed", "nixl", NO_NIXL, "bodies over tcp: NIXL did not start (", "tcp"),
    ],
    ids=["tcp", "nixl", "nixl-failed"],
)
def test_an_agent_that_reaches_every_peer_passes(
    start: Start, tmp_path: Path, case: tuple[str, str, dict[str, str], str, str]
) -> None:
    """The check says what the chunks the agent sends carry (spec.peers.wireProtection) and
    what carries them (spec.peers.transport; where NIXL did not start, why), for the agent
    and for each link to a peer."""
    protection, transport, environment, moved, link = case
    pool_key = write_peer_key(tmp_path / "pool-key")
    port_a, port_b = free_port(), free_port()
    mode = {"PEERS__WIRE_PROTECTION": protection, "PEERS__TRANSPORT": transport}
    agent = start("node-a", port_a, pool_key, {"node-b": port_b}, environment, **mode)
    start("node-b", port_b, pool_key, {"node-a": port_a}, **mode)

    diagnosis = run_doctor(*agent_args(agent), env=ADMIN_ENV)

    assert diagnosis.returncode == 0, diagnosis.output
    check = diagnosis.checks["peers"]
    assert check.outcome == "PASS", diagnosis.output
    assert check.seen.startswith(
        f"node-a (peer port {port_a}, {peers.WIRE[protection]}, {moved}"
    ), check.seen
    assert f") reaches its 1 peer, credential proven: node-b at 127.0.0.1:{port_b} (" in (
        check.seen
    )
    assert check.seen.endswith(f" ms, {link})"), check.seen


def test_each_unreachable_peer_is_a_warning_naming_it_and_why(start: Start, tmp_path: Path) -> None:
    """One peer holds another pool's credential, one is not running: both named, each
    with its error; the node still works (a WARN: exit status 0)."""
    port_a, port_b, port_c = free_port(), free_port(), free_port()
    agent = start(
        "node-a",
        port_a,
        write_peer_key(tmp_path / "pool-key"),
        {"node-b": port_b, "node-c": port_c},
    )
    start("node-b", port_b, write_peer_key(tmp_path / "other-key"), {"node-a": port_a})

    diagnosis = run_doctor(*agent_args(agent), env=ADMIN_ENV)

    assert diagnosis.returncode == 0, diagnosis.output
    check = diagnosis.checks["peers"]
    assert check.outcome == "WARN", diagnosis.output
    assert check.seen.startswith(
        f"node-a (peer port {port_a}, chunks sent sealed, bodies over tcp) reaches 0 of its "
        "2 peers; "
    )
    unreachable = dict(
        part.split(": ", 1) for part in check.seen.split("; ")[1:]
    )  # "node-b at HOST:PORT: why"
    assert set(unreachable) == {
        f"node-b at 127.0.0.1:{port_b}",
        f"node-c at 127.0.0.1:{port_c}",
    }, check.seen
    assert all(why and why != "not reached" for why in unreachable.values()), check.seen
    assert (
        unreachable[f"node-b at 127.0.0.1:{port_b}"] != unreachable[f"node-c at 127.0.0.1:{port_c}"]
    )
    assert check.fix == peers.UNREACHABLE_FIX


def test_an_agent_that_knows_no_other_agent_says_so(start: Start, tmp_path: Path) -> None:
    agent = start("alone", free_port(), write_peer_key(tmp_path / "pool-key"), {})
    check = run_doctor(*agent_args(agent), env=ADMIN_ENV).checks["peers"]
    assert check.outcome == "PASS"
    assert check.seen.startswith("alone (peer port ") and "knows no other agent" in check.seen


def test_an_agent_without_peers_is_skipped_saying_so(agent: AgentProcess) -> None:
    """The harness's agent has no peers section (spec.peers.enabled: false): 404."""
    check = run_doctor(*agent_args(agent), env=ADMIN_ENV).checks["peers"]
    assert (check.outcome, check.seen) == ("SKIP", peers.OFF)


def test_the_peers_check_needs_an_admin_token(agent: AgentProcess) -> None:
    without = run_doctor(*agent_args(agent)).checks["peers"]
    assert (without.outcome, without.seen) == (
        "SKIP",
        "no admin token (--admin-token-file, or KVPOOL_ADMIN_TOKEN)",
    )
    wrong = run_doctor(*agent_args(agent), env={"KVPOOL_ADMIN_TOKEN": "not-a-token"})
    assert wrong.returncode == 1
    assert wrong.checks["peers"].outcome == "FAIL"
    assert wrong.checks["peers"].seen.endswith(
        "/v1/peers?probe=true: 401: the agent refused the token"
    )
