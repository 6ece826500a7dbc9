"""The hosts harness: network namespaces on one bridge reach each other and the test process
by address, not over loopback; a link cut is a timeout; closing (or a later run, after a
crash) leaves nothing behind; an agent runs inside a host and serves at its address."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvpool.tools.bench.local import hosts as hosts_module
from kvpool.tools.bench.local.hosts import Host, Hosts, HostsUnavailable
from tests.support.agent_process import AgentProcess
from tests.support.hosts import hosts_or_skip
from tests.support.polling import eventually

pytestmark = [pytest.mark.process, pytest.mark.root, pytest.mark.netns]

SERVE = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
while True:
    connection, peer = server.accept()
    connection.sendall(peer[0].encode())
    connection.close()
"""
"""A server on the host's address: its port on stdout, then to each client the address it
sees the client connect from."""
ASK = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
    print(c.recv(64).decode())
"""
"""A client: what the server at ARGV 1:2 saw it connect from (exit status 1 on a timeout)."""


def serve(host: Host) -> int:
    """Start SERVE inside ``host``; its port."""
    server = host.popen([sys.executable, "-c", SERVE, host.address], stdout=subprocess.PIPE)
    assert server.stdout is not None
    return int(server.stdout.readline())


def ask(address: str, port: int, timeout: float = 5.0) -> str:
    """ASK from the test process (the root namespace)."""
    with socket.create_connection((address, port), timeout=timeout) as client:
        return client.recv(64).decode()


def answered(address: str, port: int) -> str:
    """:func:`ask` once; a connection that fails is an AssertionError, which
    :func:`eventually` retries (a link just up may first time out while the neighbours are
    resolved again, the longer on a loaded machine)."""
    try:
        return ask(address, port, timeout=0.5)
    except OSError as error:
        raise AssertionError(f"{address}:{port} not reachable yet: {error}") from error


def ask_from(host: Host, address: str, port: int, timeout: float = 5.0) -> str:
    """ASK from inside ``host``; "" if it could not connect."""
    client = host.popen(
        [sys.executable, "-c", ASK, address, str(port), str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    said, _ = client.communicate(timeout=timeout + 10)
    return said.strip() if client.returncode == 0 else ""


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def test_two_hosts_reach_each_other_at_their_own_addresses(hosts: Hosts) -> None:
    a, b = hosts.hosts
    assert len({a.address, b.address, hosts.root_address}) == 3
    assert not a.address.startswith("127.")

    assert ask_from(a, b.address, serve(b)) == a.address  # not loopback: A's own address
    assert ask_from(b, a.address, serve(a)) == b.address


def test_the_test_process_reaches_every_host(hosts: Hosts) -> None:
    for host in hosts.hosts:
        assert ask(host.address, serve(host)) == hosts.root_address


def test_a_link_down_cuts_the_host_off_until_it_is_up_again(hosts: Hosts) -> None:
    a, b = hosts.hosts
    port = serve(b)
    assert ask(b.address, port) == hosts.root_address

    b.link_down()
    started = time.monotonic()
    with pytest.raises(OSError):  # a timeout, or no route to the host
        ask(b.address, port, timeout=0.5)
    assert time.monotonic() - started < 2
    assert ask_from(a, b.address, port, timeout=0.5) == ""

    b.link_up()
    assert eventually(lambda: answered(b.address, port), timeout=15, what="link up")
    assert ask_from(a, b.address, port) == a.address


def test_an_agent_inside_a_host_serves_at_the_host_address(
    hosts: Hosts, agent_process: AgentProcess
) -> None:
    host = hosts.hosts[1]
    agent_process.host = host
    agent_process.start()

    assert agent_process.http.startswith(f"http://{host.address}:")
    assert agent_process.zmq.startswith(f"tcp://{host.address}:")
    assert httpx.get(f"{agent_process.http}/healthz", timeout=5).status_code == 200
    assert ip("netns", "identify", str(agent_process.pid)).strip() == host.name


def ours() -> tuple[list[str], list[str]]:
    """This process's namespaces and interfaces (root namespace), by their names."""
    namespaces = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
    pid = str(os.getpid())
    return (
        [name for name in namespaces if name.startswith(f"kvh-{pid}-")],
        [name for name in os.listdir("/sys/class/net") if name.startswith(f"kvh{pid}")],
    )


def test_closing_removes_every_namespace_interface_and_process_also_on_an_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt), hosts_or_skip(2) as made:
        namespaces, links = ours()
        assert len(namespaces) == 2 and len(links) == 3  # two veths and the bridge
        inside = made.hosts[0].popen(["sleep", "60"])
        raise KeyboardInterrupt

    assert ours() == ([], [])
    assert inside.returncode == -9


def test_a_start_removes_what_a_killed_run_left() -> None:
    with hosts_or_skip(1):  # this machine can make hosts
        pass
    gone = subprocess.Popen(["true"])
    gone.wait()
    namespace, bridge = f"kvh-{gone.pid}-0", f"kvh{gone.pid}b"

    def inside() -> None:
        assert ip("netns", "pids", namespace).split()

    with hosts_module.locked():  # made whole before any run's sweep sees them
        ip("netns", "add", namespace)
        ip("link", "add", bridge, "type", "bridge")
        pair = ("type", "veth", "peer", "name", "eth0", "netns", namespace)
        ip("link", "add", f"kvh{gone.pid}v0", *pair)
        orphan = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "60"])
        eventually(inside, timeout=5, what="the orphan inside the dead run's namespace")

    with hosts_or_skip(1):
        assert namespace not in ip("netns", "list")
        assert not [name for name in os.listdir("/sys/class/net") if f"kvh{gone.pid}" in name]
        assert orphan.wait(5) == -9


def test_no_root_or_no_ip_command_is_hosts_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts_module.os, "geteuid", lambda: 1000)
    with pytest.raises(HostsUnavailable, match=r"^network namespaces need root"):
        Hosts(2).start()
    monkeypatch.undo()

    monkeypatch.setattr(hosts_module.shutil, "which", lambda *_, **__: None)
    monkeypatch.setattr(hosts_module.os, "geteuid", lambda: 0)
    with pytest.raises(HostsUnavailable, match=r"^no `ip` command"):
        Hosts(2).start()
