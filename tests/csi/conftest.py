"""A real ``kvpool-csi`` process in a mount namespace of its own (``unshare``), so that its
bind mounts never reach this machine's; the tests look into that namespace with
``nsenter``. The node's kubelet directory and shared memory are temporary directories; a
pool's directory holds what its agent makes there: the segment, its probe table and lock,
and the door (a listening Unix socket)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from kvpool.common.names import (
    API_GROUP,
    API_VERSION,
    DOOR_DIRECTORY,
    DOOR_SOCKET,
    POOL_PLURAL,
    SEGMENT_FILE,
    SEGMENT_PATH_ANNOTATION,
    service_name,
)
from kvpool.common.probe_table import table_path
from kvpool.common.segment import lock_path
from kvpool.csi.mounts import Mount, parse_mountinfo
from tests.support.csi_kubelet import CsiClient, discover
from tests.support.kube_api import ServedApi
from tests.support.operator_process import Kubectl
from tests.support.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "inference"
NODE = "node-1"
ENGINES = "serving"
"""The pools' engine namespace: its pods may map their segments."""
SEGMENT_BYTES = b"kvpool segment " * 64

NEEDS_MOUNT_NAMESPACES = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")),
    reason="needs root, unshare and nsenter (mount namespaces)",
)


CONNECT = """
import os, socket, sys
directory, name = os.path.split(sys.argv[1])
os.chdir(directory)  # a pod's path is short; a pod volume's path on the node may be too long
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as door:
    door.connect(name)
    door.sendall(sys.stdin.read().encode())
"""


class Door:
    """The agent's door: a listening Unix socket (mode 0666) alone in a directory (0755)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir()
        path.parent.chmod(0o755)
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.socket.bind(str(path))
        path.chmod(0o666)
        self.socket.listen(8)
        self.socket.settimeout(5)

    def received(self) -> bytes:
        """What the next connection sent (a pod's connect is queued until accepted here)."""
        connection, _ = self.socket.accept()
        with connection:
            return connection.recv(256)

    def close(self) -> None:
        self.socket.close()


@dataclass
class Node:
    """The node's directories, as the plugin sees them."""

    root: Path
    kubelet: Path = field(init=False)
    shm: Path = field(init=False)
    registry: Path = field(init=False)
    socket: Path = field(init=False)
    doors: dict[str, Door] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.kubelet = self.root / "kubelet"
        self.shm = self.root / "shm"
        self.registry = self.kubelet / "plugins_registry"
        self.socket = self.kubelet / "plugins" / "csi.kvpool.io" / "csi.sock"
        for directory in (self.kubelet / "pods", self.shm, self.registry, self.socket.parent):
            directory.mkdir(parents=True)

    def pool_directory(self, pool: str, *, door: bool = True) -> Path:
        """The pool's directory as its agent makes it: a segment of known bytes, its probe
        table and lock, and (``door``) the door."""
        directory = self.shm / f"kvpool-{pool}"
        directory.mkdir(mode=0o710)
        segment = directory / SEGMENT_FILE
        segment.write_bytes(SEGMENT_BYTES)
        segment.chmod(0o660)
        for beside in (table_path(segment), lock_path(segment)):
            beside.write_bytes(b"")
            beside.chmod(0o660)
        if door:
            self.open_door(pool)
        return directory

    def open_door(self, pool: str) -> Door:
        """The pool's door, as its agent opens it at start."""
        path = self.shm / f"kvpool-{pool}" / DOOR_DIRECTORY / DOOR_SOCKET
        self.doors[pool] = Door(path)
        return self.doors[pool]

    def close(self) -> None:
        for door in self.doors.values():
            door.close()


class PluginProcess:
    def __init__(self, node: Node, kubeconfig: Path) -> None:
        self.node = node
        self.log_path = node.root / "plugin.log"
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), NODE_NAME=NODE)
        env["PYTHONPATH"] = str(ROOT / "src")
        env.pop("KUBERNETES_SERVICE_HOST", None)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [
                    *("unshare", "--mount", "--propagation", "private"),
                    *(sys.executable, "-m", "kvpool.csi.main"),
                    f"--endpoint=unix://{node.socket}",
                    f"--registration-dir={node.registry}",
                    f"--kubelet-endpoint={node.socket}",
                    f"--kubelet-dir={node.kubelet}",
                    f"--shm-dir={node.shm}",
                    "--api-timeout=2",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_until(
            lambda: "csi plugin ready" in self.log() or self.process.poll() is not None,
            what="the plugin's start",
        )
        assert self.process.poll() is None, self.log()

    @property
    def registration(self) -> Path:
        return self.node.registry / "csi.kvpool.io-reg.sock"

    def log(self) -> str:
        return self.log_path.read_text()

    def mounts(self) -> list[Mount]:
        """The mount table of the plugin's namespace."""
        return parse_mountinfo(Path(f"/proc/{self.process.pid}/mountinfo").read_text())

    def inside(self, code: str, *args: str) -> str:
        """Run Python ``code`` in the plugin's mount namespace; its stdout."""
        namespace = f"--mount=/proc/{self.process.pid}/ns/mnt"
        done = subprocess.run(
            ["nsenter", namespace, sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def opens_as(self, uid: int, groups: list[int], path: Path) -> bool:
        """Whether user ``uid`` with supplementary ``groups`` opens ``path`` read-write (as
        mapping the segment needs) in the plugin's mount namespace, as a pod's user would."""
        namespace = f"--mount=/proc/{self.process.pid}/ns/mnt"
        who = [f"--reuid={uid}", f"--regid={uid}"]
        who += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
        done = subprocess.run(
            ["nsenter", namespace, "setpriv", *who, "sh", "-c", ': 3<>"$1"', "sh", str(path)],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        assert done.returncode == 0 or "Permission denied" in done.stderr, done.stderr
        return done.returncode == 0

    def connects_as(self, uid: int, groups: list[int], path: Path, message: str) -> str:
        """Connect to the Unix socket ``path`` as user ``uid`` with supplementary ``groups``
        in the plugin's mount namespace, as a pod's user would, and send ``message``; the
        error's last line, or empty if it was sent."""
        namespace = f"--mount=/proc/{self.process.pid}/ns/mnt"
        who = [f"--reuid={uid}", f"--regid={uid}"]
        who += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
        done = subprocess.run(
            ["nsenter", namespace, "setpriv", *who, sys.executable, "-c", CONNECT, str(path)],
            input=message,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return "" if done.returncode == 0 else done.stderr.strip().splitlines()[-1]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)


def pool_object(pool: str, engines: Sequence[str]) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "KVCachePool",
        "metadata": {"name": pool},
        "spec": {"engineNamespaces": list(engines)},
    }


class Pools:
    """Pools on the API server: each a KVCachePool and a Service with the segment
    annotation."""

    def __init__(self, api: ServedApi) -> None:
        self.core = api.core_api()
        self.custom = client.CustomObjectsApi(self.core.api_client)

    def add(
        self,
        pool: str,
        segment: str,
        engines: Sequence[str] = (ENGINES,),
        *,
        with_pool: bool = True,
    ) -> None:
        """The pool's Service and (``with_pool``) its KVCachePool, whose pods of ``engines``
        may map its segment."""
        service = {
            "metadata": {
                "name": service_name(pool),
                "annotations": {SEGMENT_PATH_ANNOTATION: segment},
            },
            "spec": {"ports": [{"name": "zmq", "port": 7400}]},
        }
        if with_pool:
            self.custom.create_namespaced_custom_object(
                API_GROUP, API_VERSION, NAMESPACE, POOL_PLURAL, pool_object(pool, engines)
            )
        self.core.create_namespaced_service(NAMESPACE, service)

    def set_engines(self, pool: str, engines: Sequence[str]) -> None:
        patch = {"spec": {"engineNamespaces": list(engines)}}
        self.custom.patch_namespaced_custom_object(
            API_GROUP, API_VERSION, NAMESPACE, POOL_PLURAL, pool, patch
        )


@contextlib.contextmanager
def short_root() -> Iterator[Path]:
    """A temporary directory with a short path: a unix socket's path has at most 107
    characters."""
    root = Path(tempfile.mkdtemp(prefix="kvpool-csi-", dir="/tmp"))
    root.chmod(0o755)  # a pod's non-root user reaches its volume's mount point
    try:
        yield root
    finally:
        shutil.rmtree(root)


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with short_root() as root:
        node = Node(root)
        yield node
        node.close()


@pytest.fixture(scope="module")
def pools(served_api: ServedApi, kubectl: Kubectl) -> Pools:
    kubectl("apply", "--validate=false", "-f", str(ROOT / "crds"))  # KVCachePools
    pools = Pools(served_api)
    pools.core.create_namespace({"metadata": {"name": NAMESPACE}})
    return pools


@pytest.fixture(scope="module")
def plugin(node: Node, served_api: ServedApi, pools: Pools) -> Iterator[PluginProcess]:
    process = PluginProcess(node, served_api.kubeconfig())
    yield process
    assert process.stop() == 0, process.log()
    host = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    assert not [mount for mount in host if mount.mount_point.startswith(str(node.root))]


@pytest.fixture(scope="module")
def kubelet(plugin: PluginProcess) -> Iterator[CsiClient]:
    with discover(plugin.registration) as client:
        yield client
