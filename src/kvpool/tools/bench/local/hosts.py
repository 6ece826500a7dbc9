"""Several hosts on one machine: network namespaces cabled by veth pairs to one bridge.

The peer tier's tests and benches run one agent per host, so that agents reach each other
at addresses of their own over a real link (the kernel's TCP stack over veth, MTU 1500: no
loopback shortcut), and a host can be cut off. The test process stays in the root
namespace: the bridge holds an address on the hosts' /24 (chosen per run in 10.200.0.0/16,
clear of every route of this machine), so it reaches every host.

A run names its objects after its pid (namespaces ``kvh-<pid>-<i>``, interfaces
``kvh<pid>b`` and ``kvh<pid>v<i>``: at most 15 characters), so that parallel runs never
collide and a run that finds objects of a run whose process is gone (killed before it
could clean up) removes them. One :class:`Hosts` at a time per process. Needs root and
iproute2; where there is none, :class:`HostsUnavailable` says why in one line (tests skip
with it). ``kvpool bench cluster``, the peer tests and the repository's ``benchmarks/peer.py``
use it.

A machine whose kernel sends bridged traffic through iptables (``br_netfilter`` with a
FORWARD policy of DROP, as Docker leaves it) drops what one host sends another.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

PREFIX = "kvh"
NAMESPACE = re.compile(rf"^{PREFIX}-(\d+)-\d+$")
LINK = re.compile(rf"^{PREFIX}(\d+)[bv]\d*$")
"""Names of a run's namespaces and of its interfaces in the root namespace; group 1: its pid."""
SUBNETS = ipaddress.IPv4Network("10.200.0.0/16")
ROOT_HOST = 254
"""The bridge's address on a run's /24; the hosts have 1, 2, ..."""
DEVICE = "eth0"
"""The name of a host's end of its veth pair, inside its namespace."""
LOCK = Path(tempfile.gettempdir()) / "kvpool-hosts.lock"
"""Held while a run sweeps stale objects and picks its /24: two runs never pick the same."""


class HostsUnavailable(RuntimeError):
    """This machine cannot make hosts (not root, no iproute2, namespaces refused): why."""


@dataclass
class Host:
    """One host: a network namespace whose ``eth0`` has ``address``, cabled to the bridge."""

    name: str
    """The network namespace."""
    address: str
    link: str
    """The root namespace's end of the host's veth pair (on the bridge)."""
    ip: str
    """The ``ip`` command (iproute2)."""
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside this host."""
        return [self.ip, "netns", "exec", self.name]

    def popen(self, argv: Sequence[str], **options: Any) -> subprocess.Popen[str]:
        """``subprocess.Popen`` inside this host, text mode; killed when the hosts close."""
        process = subprocess.Popen([*self.prefix, *argv], text=True, **options)
        self.processes.append(process)
        return process

    def link_down(self) -> None:
        """Cut the host off (its cable pulled at the bridge): what it sends or is sent is
        lost, connections in flight stall, new ones time out."""
        _ip(self.ip, f"link set {self.link} down")

    def link_up(self) -> None:
        """Cable the host again."""
        _ip(self.ip, f"link set {self.link} up")

    @contextlib.contextmanager
    def throttled(self, rate: str) -> Iterator[None]:
        """While the block runs, what is sent to the host crawls at ``rate`` (``tc``'s
        units, e.g. ``8mbit``: a token bucket at the bridge's end of its cable; this
        kernel may lack ``netem``, so there is no added latency)."""
        tc = shutil.which("tc")
        if tc is None:
            raise HostsUnavailable("no tc (iproute2) to shape a host's link")
        shape = f"qdisc replace dev {self.link} root tbf rate {rate} burst 32kbit latency 2s"
        subprocess.run([tc, *shape.split()], check=True, capture_output=True)
        try:
            yield
        finally:
            subprocess.run([tc, "qdisc", "del", "dev", self.link, "root"], check=False)


class Hosts:
    """``count`` hosts on one bridge, made by :meth:`start` (or ``with``), removed by
    :meth:`close` with every process that runs inside them."""

    _live: ClassVar[bool] = False

    def __init__(self, count: int) -> None:
        if not 1 <= count < ROOT_HOST:
            raise ValueError(f"between 1 and {ROOT_HOST - 1} hosts, not {count}")
        self.count = count
        self.hosts: list[Host] = []
        self.root_address = ""
        """The root namespace's address on the hosts' /24 (the test process's)."""
        self._ip = ""
        self._started = False

    def __enter__(self) -> Hosts:
        """Start the hosts, unless :meth:`start` did (the caller handled HostsUnavailable)."""
        return self if self._started else self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> Hosts:
        """Make the bridge and the hosts; HostsUnavailable where this machine cannot."""
        if Hosts._live:
            raise RuntimeError("one Hosts at a time per process: their names are the pid's")
        if os.geteuid() != 0:
            raise HostsUnavailable(f"network namespaces need root (this is uid {os.geteuid()})")
        self._ip = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin") or ""
        if not self._ip:
            raise HostsUnavailable("no `ip` command (iproute2) on this machine")
        Hosts._live = self._started = True
        try:
            with locked():
                _remove_stale(self._ip)
                subnet = _free_subnet(self._ip)
                self.root_address = str(subnet[ROOT_HOST])
                bridge = f"{PREFIX}{os.getpid()}b"
                _ip(self._ip, f"link add {bridge} type bridge", refused="no bridge")
                _ip(self._ip, f"addr add {self.root_address}/24 dev {bridge}")
                _ip(self._ip, f"link set {bridge} up")
            for index in range(self.count):
                self.hosts.append(self._cable(index, str(subnet[index + 1]), bridge))
        except BaseException:
            self.close()
            raise
        return self

    def _cable(self, index: int, address: str, bridge: str) -> Host:
        pid = os.getpid()
        host = Host(f"{PREFIX}-{pid}-{index}", address, f"{PREFIX}{pid}v{index}", self._ip)
        ip, inside = self._ip, f"-n {host.name}"
        _ip(ip, f"netns add {host.name}", refused="no network namespace")
        pair = f"link add {host.link} type veth peer name {DEVICE} netns {host.name}"
        _ip(ip, pair, refused="no veth pair")
        _ip(ip, f"link set {host.link} master {bridge} up")
        _ip(ip, f"{inside} addr add {address}/24 dev {DEVICE}")
        _ip(ip, f"{inside} link set {DEVICE} up")
        _ip(ip, f"{inside} link set lo up")
        return host

    def close(self) -> None:
        """Kill every process inside the hosts, remove the hosts and the bridge."""
        if not self._started:
            return
        for host in self.hosts:
            for process in host.processes:
                process.kill()  # if it runs: it may not have entered the namespace yet
                process.wait()
        _remove_run(self._ip, os.getpid())
        self.hosts.clear()
        Hosts._live = self._started = False


def _ip(ip: str, command: str, refused: str = "") -> str:
    """Run ``ip`` with the words of ``command`` (names hold no spaces); its output. A failure
    is HostsUnavailable if ``refused`` names what this machine lacks when that command
    fails, else RuntimeError."""
    result = subprocess.run([ip, *command.split()], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        said = (result.stderr.strip().splitlines() or ["(nothing on stderr)"])[0]
        if refused:
            raise HostsUnavailable(f"{refused}: `ip {command}` failed: {said}")
        raise RuntimeError(f"`ip {command}` failed: {said}")
    return result.stdout


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Hold LOCK: no run sweeps stale objects or picks a /24 meanwhile."""
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _namespaces(ip: str) -> list[str]:
    return [line.split()[0] for line in _ip(ip, "netns list").splitlines() if line.strip()]


def _links() -> list[str]:
    """The interfaces of the root namespace (this process's)."""
    return os.listdir("/sys/class/net")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    """The pid of the run that made the namespace or interface ``name``; None: no run's."""
    match = NAMESPACE.match(name) or LINK.match(name)
    return int(match.group(1)) if match else None


def _remove_stale(ip: str) -> None:
    """Remove the objects of every run whose process is gone."""
    owners = {_owner(name) for name in [*_namespaces(ip), *_links()]}
    for pid in sorted(pid for pid in owners if pid is not None):
        if pid != os.getpid() and not _alive(pid):
            _remove_run(ip, pid)


def _remove_run(ip: str, pid: int) -> None:
    """Kill the processes inside run ``pid``'s namespaces, then remove its interfaces (a veth
    pair goes with its root end) and namespaces."""
    namespaces = [name for name in _namespaces(ip) if _owner(name) == pid]
    for name in namespaces:
        for inside in _ip(ip, f"netns pids {name}").split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(inside), signal.SIGKILL)
    for link in _links():
        if _owner(link) == pid:
            _ip(ip, f"link del {link}")
    for name in namespaces:
        _ip(ip, f"netns del {name}")


def _free_subnet(ip: str) -> ipaddress.IPv4Network:
    """A /24 of SUBNETS that overlaps no route of the root namespace (another run's bridge
    among them), tried from one the pid picks."""
    routes = [
        ipaddress.ip_network(route["dst"], strict=False)
        for route in json.loads(_ip(ip, "-j -4 route show table all") or "[]")
        if route.get("dst", "default") != "default"
    ]
    candidates = list(SUBNETS.subnets(new_prefix=24))
    start = os.getpid() % len(candidates)
    for subnet in candidates[start:] + candidates[:start]:
        if not any(subnet.overlaps(route) for route in routes):
            return subnet
    raise HostsUnavailable(f"no /24 of {SUBNETS} is free of this machine's routes")
