"""``kvpool-csi`` as the kubelet drives it: registration, identity, and a pool's directory
published into a pod's volume (in the plugin's own mount namespace), then unpublished: the
whole directory (segment, probe table, lock, door) to a pod of the pool's engineNamespaces,
its door only, read-only, to any other pod; and every publish it refuses, with the gRPC code
and the value named."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvpool.common.names import (
    CONNECTOR_DOOR_PATH_ENV,
    CONNECTOR_SEGMENT_PATH_ENV,
    CSI_DRIVER,
    CSI_NAMESPACE_ATTRIBUTE,
    CSI_POOL_ATTRIBUTE,
    DOOR_DIRECTORY,
    DOOR_SOCKET,
    SEGMENT_FILE,
)
from kvpool.common.probe_table import table_path
from kvpool.common.segment import lock_path
from kvpool.csi import messages
from kvpool.csi.mounts import PUBLISHED_OPTIONS, parse_mountinfo
from kvpool.operator.admission.wiring import AGENT_GROUP, Binding, PoolFacts, apply, wire
from kvpool.operator.render import AGENT_UID
from tests.support import csi_kubelet
from tests.support.csi_kubelet import CsiClient, target_path
from tests.support.kube_api import ServedApi

from .conftest import (
    ENGINES,
    NAMESPACE,
    NEEDS_MOUNT_NAMESPACES,
    NODE,
    SEGMENT_BYTES,
    Node,
    PluginProcess,
    Pools,
    short_root,
)

pytestmark = [pytest.mark.process, pytest.mark.root, NEEDS_MOUNT_NAMESPACES]

UID = "0f1e2d3c-0000-4000-8000-00000000000a"

READ_AND_WRITE = """
import mmap, sys
with open(sys.argv[1], "r+b") as file, mmap.mmap(file.fileno(), 0) as view:
    print(view[:15].hex())
    view[:8] = b"from pod"
"""


LIST = """
import os, sys
print(" ".join(sorted(os.listdir(sys.argv[1]))))
"""
WRITE = """
import os, sys
target, door = sys.argv[1:]
attempts = (
    lambda: open(os.path.join(target, "planted"), "w"),
    lambda: os.mkdir(os.path.join(target, "planted")),
    lambda: os.unlink(os.path.join(target, door)),
    lambda: os.chmod(target, 0o777),
)
for attempt in attempts:
    try:
        attempt()
        print("written")
    except OSError as error:
        print(error.errno)
"""
POOL_FILES = sorted(
    [SEGMENT_FILE, table_path(Path(SEGMENT_FILE)).name, lock_path(Path(SEGMENT_FILE)).name]
)
"""What the agent keeps in a pool's directory beside its door."""


def attributes(pool: str = "main") -> dict[str, str]:
    return {CSI_POOL_ATTRIBUTE: pool, CSI_NAMESPACE_ATTRIBUTE: NAMESPACE}


@pytest.fixture(scope="module")
def main_pool(node: Node, pools: Pools) -> Path:
    directory = node.pool_directory("main")
    pools.add("main", str(directory / "segment"))
    return directory


def refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    return caught.value


def host_mount_points() -> set[str]:
    return {
        mount.mount_point for mount in parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    }


def listed(plugin: PluginProcess, directory: Path) -> list[str]:
    """The names in ``directory`` as the plugin's mount namespace (a pod) sees it."""
    return plugin.inside(LIST, str(directory)).split()


def assert_door_only(plugin: PluginProcess, node: Node, target: Path, pool: str) -> None:
    """``target`` holds the pool's door and nothing else of its directory, read-only (a
    write fails with EROFS, even as root), and a pod's user without the agents' group
    reaches the agent's socket through it."""
    (mounted,) = [mount for mount in plugin.mounts() if mount.mount_point == str(target)]
    assert mounted.root.endswith(f"/kvpool-{pool}/{DOOR_DIRECTORY}"), mounted
    assert PUBLISHED_OPTIONS | {"ro"} <= mounted.options
    assert listed(plugin, target) == [DOOR_SOCKET]
    assert plugin.inside(WRITE, str(target), DOOR_SOCKET).split() == [str(errno.EROFS)] * 4
    assert plugin.connects_as(1000, [], target / DOOR_SOCKET, "tenant") == ""
    assert node.doors[pool].received() == b"tenant"


def test_registration_names_the_driver_and_the_kubelets_endpoint(plugin: PluginProcess) -> None:
    info = csi_kubelet.plugin_info(plugin.registration)

    assert info.type == "CSIPlugin"
    assert info.name == CSI_DRIVER
    assert info.endpoint == str(plugin.node.socket)
    assert list(info.supported_versions) == ["1.0.0"]

    csi_kubelet.notify(plugin.registration, False, "driver name taken")
    assert "did not register csi.kvpool.io: driver name taken" in plugin.log()


def test_identity_and_node_info(kubelet: CsiClient) -> None:
    assert kubelet.probe()
    info = kubelet.identity(
        "GetPluginInfo", messages.GetPluginInfoRequest(), messages.GetPluginInfoResponse
    )
    assert info.name == CSI_DRIVER
    assert info.vendor_version
    capabilities = kubelet.identity(
        "GetPluginCapabilities",
        messages.GetPluginCapabilitiesRequest(),
        messages.GetPluginCapabilitiesResponse,
    )
    assert list(capabilities.capabilities) == []  # no controller service
    node_info = kubelet.node(
        "NodeGetInfo", messages.NodeGetInfoRequest(), messages.NodeGetInfoResponse
    )
    assert node_info.node_id == NODE
    node_capabilities = kubelet.node(
        "NodeGetCapabilities",
        messages.NodeGetCapabilitiesRequest(),
        messages.NodeGetCapabilitiesResponse,
    )
    assert list(node_capabilities.capabilities) == []


def test_publish_then_unpublish(
    kubelet: CsiClient, plugin: PluginProcess, node: Node, main_pool: Path
) -> None:
    target = target_path(node.kubelet, UID, "kvpool")

    kubelet.publish(target, attributes(), ENGINES, "vllm-0", UID)

    mounted = [mount for mount in plugin.mounts() if mount.mount_point == str(target)]
    assert len(mounted) == 1
    assert PUBLISHED_OPTIONS | {"rw"} <= mounted[0].options
    # an engine's pod sees the pool's whole directory, its door too
    assert listed(plugin, target) == sorted([DOOR_DIRECTORY, *POOL_FILES])
    assert plugin.connects_as(0, [], target / DOOR_DIRECTORY / DOOR_SOCKET, "engine") == ""
    assert node.doors["main"].received() == b"engine"
    # the pod sees the agent's segment, and what one writes the other reads
    seen = plugin.inside(READ_AND_WRITE, str(target / "segment"))
    assert bytes.fromhex(seen) == SEGMENT_BYTES[:15]
    assert (main_pool / "segment").read_bytes()[:8] == b"from pod"
    with (main_pool / "segment").open("r+b") as segment:
        segment.write(b"from the agent!")
    assert bytes.fromhex(plugin.inside(READ_AND_WRITE, str(target / "segment"))) == (
        b"from the agent!"
    )
    assert str(target) not in host_mount_points()  # the bind mount stays in its namespace

    kubelet.publish(target, attributes(), ENGINES, "vllm-0", UID)  # again: nothing changes
    assert [mount.mount_point for mount in plugin.mounts()].count(str(target)) == 1

    kubelet.unpublish(target, UID)
    assert str(target) not in {mount.mount_point for mount in plugin.mounts()}
    assert not target.exists()
    kubelet.unpublish(target, UID)  # again: OK
    assert "NodePublishVolume volume=csi-" in plugin.log()


def test_a_non_root_pod_in_the_agents_group_may_map_the_segment(
    kubelet: CsiClient, plugin: PluginProcess, node: Node, pools: Pools
) -> None:
    """The plugin changes no mode: the agent's (a 0710 directory and a 0660 segment of its
    group) let a pod's own user in through the group the webhook adds, and no other."""
    directory = node.pool_directory("grouped")
    for path in (directory, directory / "segment"):
        os.chown(path, AGENT_UID, AGENT_UID)
    pools.add("grouped", str(directory / "segment"))
    uid = "0f1e2d3c-0000-4000-8000-00000000000b"
    target = target_path(node.kubelet, uid, "kvpool")
    kubelet.publish(target, attributes("grouped"), ENGINES, "vllm-1", uid)
    try:
        assert plugin.opens_as(1000, [AGENT_GROUP], target / "segment")
        assert not plugin.opens_as(1000, [], target / "segment")
        door = target / DOOR_DIRECTORY / DOOR_SOCKET
        assert plugin.connects_as(1000, [AGENT_GROUP], door, "grouped") == ""
        assert node.doors["grouped"].received() == b"grouped"
    finally:
        kubelet.unpublish(target, uid)


@pytest.mark.parametrize("namespace", ["team-a", ENGINES])
def test_a_wired_pods_variables_name_what_the_plugin_publishes(
    kubelet: CsiClient, plugin: PluginProcess, node: Node, pools: Pools, namespace: str
) -> None:
    """A pod as the webhook wires it, its volume published as the kubelet asks (readOnly
    from the volume), its own non-root user with the groups the webhook gave it: its
    KVPOOL_DOOR_PATH reaches the agent's door, and its KVPOOL_SEGMENT_PATH (an engine's pod
    only) the segment. A tenant's pod (team-a) gets the door alone, read-only, and reaches
    no segment however it asks: not through the volume, not by mode (not the agents' group;
    only a hostPath would be a path, which Pod Security "restricted" forbids)."""
    pool = f"wired-{namespace}"
    directory = node.pool_directory(pool)
    for path in (directory, directory / "segment"):
        os.chown(path, AGENT_UID, AGENT_UID)
    pools.add(pool, str(directory / "segment"))
    facts = PoolFacts(pool, NAMESPACE, 7400, 256, frozenset({ENGINES}))
    pod: dict[str, Any] = {
        "metadata": {"labels": {"kvpool.io/cache-pool": pool}},
        "spec": {"containers": [{"name": "vllm", "image": "v"}]},
    }
    apply(wire(pod, namespace, [Binding("cache", NAMESPACE, facts)]).patch, pod)
    (volume,) = pod["spec"]["volumes"]
    (container,) = pod["spec"]["containers"]
    (mount,) = container["volumeMounts"]
    env = {variable["name"]: variable.get("value") for variable in container["env"]}
    groups = pod["spec"].get("securityContext", {}).get("supplementalGroups", [])
    uid = f"0f1e2d3c-0000-4000-8000-0000000000{'e' if namespace == ENGINES else 'c'}0"
    target = target_path(node.kubelet, uid, volume["name"])

    def in_volume(variable: str) -> Path:
        """Where the pod's path in ``variable`` is on the node."""
        return target / Path(env[variable]).relative_to(mount["mountPath"])

    readonly = bool(volume["csi"].get("readOnly"))
    kubelet.publish(
        target, volume["csi"]["volumeAttributes"], namespace, "p", uid, readonly=readonly
    )
    try:
        door = in_volume(CONNECTOR_DOOR_PATH_ENV)
        assert plugin.connects_as(1000, groups, door, namespace) == ""
        assert node.doors[pool].received() == namespace.encode()
        if namespace == ENGINES:
            assert plugin.opens_as(1000, groups, in_volume(CONNECTOR_SEGMENT_PATH_ENV))
        else:
            assert (readonly, groups, mount.get("readOnly")) == (True, [], True)
            assert CONNECTOR_SEGMENT_PATH_ENV not in env
            assert_door_only(plugin, node, target, pool)
            assert not plugin.opens_as(1000, [], directory / "segment")  # nor by mode
    finally:
        kubelet.unpublish(target, uid, volume["name"])
    if namespace != ENGINES:  # the volume asked for read-write: still the door, read-only
        kubelet.publish(target, attributes(pool), namespace, "p", uid, volume=volume["name"])
        try:
            assert_door_only(plugin, node, target, pool)
        finally:
            kubelet.unpublish(target, uid, volume["name"])


def test_unknown_pool(kubelet: CsiClient, node: Node, main_pool: Path) -> None:
    target = target_path(node.kubelet, UID, "other")
    error = refused(lambda: kubelet.publish(target, attributes("other"), ENGINES, "p", UID))

    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == f"no KVCachePool other in namespace {NAMESPACE}"
    assert not target.exists()


def test_a_forged_pool_is_refused(
    kubelet: CsiClient, node: Node, pools: Pools, main_pool: Path
) -> None:
    """A namespace's editor can make a Service and a ConfigMap that look like a pool's, and
    name another pool's directory in the annotation: without its KVCachePool, no publish;
    with one, still none of another pool's directory."""
    pools.add("forged", str(main_pool / "segment"), with_pool=False)
    target = target_path(node.kubelet, UID, "forged")
    error = refused(lambda: kubelet.publish(target, attributes("forged"), ENGINES, "p", UID))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == f"no KVCachePool forged in namespace {NAMESPACE}"

    pools.add("elsewhere", str(main_pool / "segment"))
    error = refused(lambda: kubelet.publish(target, attributes("elsewhere"), ENGINES, "p", UID))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "is not in pool elsewhere's directory" in error.details()
    assert not target.exists()


@pytest.mark.parametrize("namespace", ["team-a", NAMESPACE])
def test_a_namespace_outside_the_engines_gets_the_door_only(
    kubelet: CsiClient, plugin: PluginProcess, node: Node, main_pool: Path, namespace: str
) -> None:
    """The segment holds every tenant's KV on the node: a pod outside the pool's
    engineNamespaces (a tenant's, or one of the pool's own namespace) gets only the
    agent's door, read-only even when the kubelet asks for read-write; nothing of the
    segment, its probe table or its lock."""
    target = target_path(node.kubelet, UID, "kvpool")
    kubelet.publish(target, attributes(), namespace, "p", UID)
    try:
        assert_door_only(plugin, node, target, "main")
        for name in POOL_FILES:
            assert plugin.inside(
                "import os, sys; print(os.path.lexists(sys.argv[1]))", str(target / name)
            ).split() == ["False"]
        kubelet.publish(target, attributes(), namespace, "p", UID)  # again: nothing changes
        assert [mount.mount_point for mount in plugin.mounts()].count(str(target)) == 1
    finally:
        kubelet.unpublish(target, UID)
    assert not target.exists()
    assert "the door only, read-only) to a pod of namespace" in plugin.log()


@pytest.mark.parametrize(
    "where",
    [
        "kubelet/elsewhere/volume/mount",
        "kubelet/pods/mount",
        "kubelet/pods/uid/volumes/kubernetes.io~csi/../../../../outside/mount",
        "kubelet/pods/uid/volumes/kubernetes.io~csi/link/mount",
    ],
)
def test_target_outside_the_pods(
    kubelet: CsiClient, node: Node, main_pool: Path, where: str
) -> None:
    link = node.kubelet / "pods" / "uid" / "volumes" / "kubernetes.io~csi" / "link"
    if not link.is_symlink():
        (node.root / "outside").mkdir(exist_ok=True)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(node.root / "outside")
    target = f"{node.root}/{where}"
    request = messages.NodePublishVolumeRequest(
        volume_id="csi-1",
        target_path=target,
        volume_context={
            **attributes(),
            "csi.storage.k8s.io/ephemeral": "true",
            "csi.storage.k8s.io/pod.namespace": "team-a",
        },
    )
    request.volume_capability.mount.SetInParent()
    error = refused(
        lambda: kubelet.node("NodePublishVolume", request, messages.NodePublishVolumeResponse)
    )

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert target in error.details()
    assert not (node.root / "outside" / "mount").exists()


def test_not_ephemeral_and_block(kubelet: CsiClient, node: Node, main_pool: Path) -> None:
    target = target_path(node.kubelet, UID, "kvpool")
    error = refused(
        lambda: kubelet.publish(target, attributes(), ENGINES, "p", UID, ephemeral=False)
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "csi.storage.k8s.io/ephemeral='false'" in error.details()

    error = refused(lambda: kubelet.publish(target, attributes(), ENGINES, "p", UID, block=True))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "asks for block access" in error.details()


def test_a_pool_directory_that_is_the_shared_memory_itself(
    kubelet: CsiClient, node: Node, pools: Pools
) -> None:
    pools.add("flat", f"{node.shm}/segment")
    target = target_path(node.kubelet, UID, "flat")
    error = refused(lambda: kubelet.publish(target, attributes("flat"), ENGINES, "p", UID))

    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"publishing {node.shm} would expose other files" in error.details()


@pytest.mark.parametrize("namespace", [ENGINES, "team-a"])
def test_a_pool_whose_agent_has_not_started(
    kubelet: CsiClient, plugin: PluginProcess, node: Node, pools: Pools, namespace: str
) -> None:
    """No pool directory yet: UNAVAILABLE, which the kubelet retries. A tenant's pod waits
    for the door too: a directory without it (an agent starting) is UNAVAILABLE to it, while
    an engine's pod gets the directory, whose door comes in it once the agent opens it."""
    pool = f"later-{namespace}"
    pools.add(pool, f"{node.shm}/kvpool-{pool}/segment")
    target = target_path(node.kubelet, UID, pool)
    error = refused(lambda: kubelet.publish(target, attributes(pool), namespace, "p", UID))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert f"{node.shm}/kvpool-{pool} does not exist" in error.details()
    assert "the pool's agent has not started on this node yet" in error.details()

    node.pool_directory(pool, door=False)  # the agent starts
    if namespace == ENGINES:
        kubelet.publish(target, attributes(pool), namespace, "p", UID)
        node.open_door(pool)
        assert listed(plugin, target) == sorted([DOOR_DIRECTORY, *POOL_FILES])
    else:
        error = refused(lambda: kubelet.publish(target, attributes(pool), namespace, "p", UID))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error.details() == (
            f"the pool's door {node.shm}/kvpool-{pool}/{DOOR_DIRECTORY} does not exist: the "
            "pool's agent has not started on this node yet"
        )
        assert not target.exists()
        node.open_door(pool)  # the kubelet's retry succeeds
        kubelet.publish(target, attributes(pool), namespace, "p", UID)
        assert_door_only(plugin, node, target, pool)
    kubelet.unpublish(target, UID, pool)


def test_a_target_with_another_pool_mounted(
    kubelet: CsiClient, node: Node, pools: Pools, main_pool: Path
) -> None:
    node.pool_directory("second")
    pools.add("second", f"{node.shm}/kvpool-second/segment")
    target = target_path(node.kubelet, UID, "shared")
    kubelet.publish(target, attributes(), ENGINES, "p", UID, volume="shared")
    try:
        error = refused(lambda: kubelet.publish(target, attributes("second"), ENGINES, "p", UID))
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS
        assert f"{target} is already mounted" in error.details()
    finally:
        kubelet.unpublish(target, UID, "shared")


def test_a_namespace_removed_from_the_engines_gets_the_door_only(
    kubelet: CsiClient, plugin: PluginProcess, node: Node, pools: Pools
) -> None:
    """The pool is read at every publish: the next pod of a namespace no longer among the
    engines gets the door only."""
    node.pool_directory("revoked")
    pools.add("revoked", f"{node.shm}/kvpool-revoked/segment", [ENGINES, "team-c"])
    target = target_path(node.kubelet, UID, "revoked")
    kubelet.publish(target, attributes("revoked"), "team-c", "p", UID, volume="revoked")
    assert listed(plugin, target) == sorted([DOOR_DIRECTORY, *POOL_FILES])
    kubelet.unpublish(target, UID, "revoked")

    pools.set_engines("revoked", [ENGINES])
    kubelet.publish(target, attributes("revoked"), "team-c", "p", UID, volume="revoked")
    try:
        assert_door_only(plugin, node, target, "revoked")
    finally:
        kubelet.unpublish(target, UID, "revoked")


def test_an_api_server_that_fails(
    kubelet: CsiClient, node: Node, served_api: ServedApi, main_pool: Path
) -> None:
    target = target_path(node.kubelet, UID, "kvpool")
    with served_api.refuse("GET", "services", 500, "etcd is down"):
        error = refused(lambda: kubelet.publish(target, attributes(), ENGINES, "p", UID))

    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details().startswith(f"cannot read Service {NAMESPACE}/kvpool-main: 500")


def test_sigterm_stops_it_and_removes_its_sockets(served_api: ServedApi) -> None:
    with short_root() as root:
        plugin = PluginProcess(Node(root), served_api.kubeconfig())
        assert plugin.node.socket.is_socket() and plugin.registration.is_socket()

        assert plugin.stop() == 0
        assert not plugin.node.socket.exists()
        assert not plugin.registration.exists()
        assert "csi plugin stopped" in plugin.log()


def test_bad_flags_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.csi.main", "--endpoint", "/csi.sock"],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    )
    assert done.returncode == 2
    assert done.stderr == (
        "kvpool-csi: argument --endpoint: expected unix:///ABSOLUTE/PATH, not '/csi.sock' "
        "(see kvpool-csi --help)\n"
    )
