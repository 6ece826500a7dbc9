"""``kvpool-csi`` as the kubelet drives it: registration, identity, and a pool's segment
directory published into a pod's volume (in the plugin's own mount namespace), then
unpublished; and every publish it refuses, with the gRPC code and the value named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvpool_agent.csi import messages
from kvpool_agent.csi.mounts import PUBLISHED_OPTIONS, parse_mountinfo
from kvpool_agent.names import CSI_DRIVER, CSI_NAMESPACE_ATTRIBUTE, CSI_POOL_ATTRIBUTE
from kvpool_operator.admission.wiring import AGENT_GROUP, Binding, PoolFacts, apply, wire
from kvpool_operator.render import AGENT_UID
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

pytestmark = NEEDS_MOUNT_NAMESPACES

UID = "0f1e2d3c-0000-4000-8000-00000000000a"

READ_AND_WRITE = """
import mmap, sys
with open(sys.argv[1], "r+b") as file, mmap.mmap(file.fileno(), 0) as view:
    print(view[:15].hex())
    view[:8] = b"from pod"
"""


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
    finally:
        kubelet.unpublish(target, uid)


def test_a_tenants_wired_pod_reaches_no_segment_however_it_asks(
    kubelet: CsiClient, plugin: PluginProcess, node: Node, pools: Pools
) -> None:
    """The attacker of issue 43: a tenant's pod, as the webhook wires it (no volume, not the
    agents' group), that then asks for the volume itself. The plugin refuses it: the pod has
    no path to the segment (only a hostPath would be one, which Pod Security "restricted"
    forbids), whatever group it gives itself."""
    directory = node.pool_directory("tenants")
    for path in (directory, directory / "segment"):
        os.chown(path, AGENT_UID, AGENT_UID)
    pools.add("tenants", str(directory / "segment"))
    facts = PoolFacts("tenants", NAMESPACE, 7400, 256, frozenset({ENGINES}))
    pod: dict[str, Any] = {
        "metadata": {"labels": {"kvpool.io/cache-pool": "tenants"}},
        "spec": {"containers": [{"name": "vllm", "image": "v"}]},
    }
    apply(wire(pod, "team-a", [Binding("cache", NAMESPACE, facts)]).patch, pod)
    assert "volumes" not in pod["spec"] and "securityContext" not in pod["spec"]
    env = {
        variable["name"]: variable.get("value") for variable in pod["spec"]["containers"][0]["env"]
    }
    assert env["KVPOOL_TRANSPORT"] == "messages" and "KVPOOL_SEGMENT_PATH" not in env

    uid = "0f1e2d3c-0000-4000-8000-00000000000c"
    target = target_path(node.kubelet, uid, "kvpool")
    error = refused(lambda: kubelet.publish(target, attributes("tenants"), "team-a", "p", uid))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not target.exists()
    assert not plugin.opens_as(1000, [], directory / "segment")  # nor as wired, by mode


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
def test_a_namespace_outside_the_engines_is_refused_the_segment(
    kubelet: CsiClient, node: Node, main_pool: Path, namespace: str
) -> None:
    """The segment holds every tenant's KV on the node: a tenant's pod (or any pod outside
    the pool's engineNamespaces, the pool's own namespace too) that asks for the volume
    itself gets nothing."""
    target = target_path(node.kubelet, UID, "kvpool")
    error = refused(lambda: kubelet.publish(target, attributes(), namespace, "p", UID))

    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error.details() == (
        f"namespace {namespace} may not map pool {NAMESPACE}/main's segment: it is not in the "
        "pool's spec.engineNamespaces (the segment holds every tenant's KV; a tenant's pod "
        "gets the cache through the agent's messages)"
    )
    assert not target.exists()


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


def test_a_pool_whose_agent_has_not_started(kubelet: CsiClient, node: Node, pools: Pools) -> None:
    pools.add("later", f"{node.shm}/kvpool-later/segment")
    target = target_path(node.kubelet, UID, "later")
    error = refused(lambda: kubelet.publish(target, attributes("later"), ENGINES, "p", UID))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert f"{node.shm}/kvpool-later does not exist" in error.details()

    node.pool_directory("later")  # the agent starts: the kubelet's retry succeeds
    kubelet.publish(target, attributes("later"), ENGINES, "p", UID)
    kubelet.unpublish(target, UID, "later")


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


def test_a_namespace_removed_from_the_engines_is_refused(
    kubelet: CsiClient, node: Node, pools: Pools
) -> None:
    node.pool_directory("revoked")
    pools.add("revoked", f"{node.shm}/kvpool-revoked/segment", [ENGINES, "team-c"])
    target = target_path(node.kubelet, UID, "revoked")
    kubelet.publish(target, attributes("revoked"), "team-c", "p", UID, volume="revoked")
    kubelet.unpublish(target, UID, "revoked")

    pools.set_engines("revoked", [ENGINES])
    error = refused(
        lambda: kubelet.publish(target, attributes("revoked"), "team-c", "p", UID, volume="revoked")
    )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "namespace team-c may not map pool" in error.details()


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
        [sys.executable, "-m", "kvpool_agent.csi.main", "--endpoint", "/csi.sock"],
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
