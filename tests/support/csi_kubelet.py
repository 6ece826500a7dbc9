"""The kubelet's side of a CSI node plugin: plugin registration, then the Identity and
Node calls it makes for a pod's inline ephemeral volume (``csi:`` in the pod's volumes).

:func:`discover` reads the registration socket as the kubelet's plugin watcher does and
returns a :class:`CsiClient` on the CSI socket it names.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import grpc

from kvpool.csi import messages
from kvpool.csi.node import EPHEMERAL, POD_NAME, POD_NAMESPACE, POD_UID

REGISTRATION = "pluginregistration.Registration"
IDENTITY = "csi.v1.Identity"
NODE = "csi.v1.Node"
SERVICE_ACCOUNT = "csi.storage.k8s.io/serviceAccount.name"
TIMEOUT = 10.0


def _call(channel: grpc.Channel, path: str, request: Any, response: Any) -> Any:
    method = channel.unary_unary(
        path,
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=response.FromString,
    )
    return method(request, timeout=TIMEOUT)


def plugin_info(registration_socket: Path) -> Any:
    """GetInfo on the registration socket: the plugin's type, name, endpoint, versions."""
    with grpc.insecure_channel(f"unix://{registration_socket}") as channel:
        return _call(
            channel, f"/{REGISTRATION}/GetInfo", messages.InfoRequest(), messages.PluginInfo
        )


def notify(registration_socket: Path, registered: bool, error: str = "") -> None:
    """NotifyRegistrationStatus: what the kubelet tells a plugin after GetInfo."""
    status = messages.RegistrationStatus(plugin_registered=registered, error=error)
    with grpc.insecure_channel(f"unix://{registration_socket}") as channel:
        path = f"/{REGISTRATION}/NotifyRegistrationStatus"
        _call(channel, path, status, messages.RegistrationStatusResponse)


def discover(registration_socket: Path) -> CsiClient:
    """The client of the CSI socket the registration names, after notifying success."""
    info = plugin_info(registration_socket)
    notify(registration_socket, True)
    return CsiClient(Path(info.endpoint))


def target_path(kubelet_dir: Path, pod_uid: str, volume: str) -> Path:
    """Where the kubelet asks a CSI volume of a pod to be published."""
    return kubelet_dir / "pods" / pod_uid / "volumes" / "kubernetes.io~csi" / volume / "mount"


def volume_id(pod_uid: str, volume: str) -> str:
    """The volume id the kubelet gives an inline ephemeral volume."""
    return "csi-" + hashlib.sha256(f"{pod_uid}{volume}".encode()).hexdigest()


class CsiClient:
    """The Identity and Node calls on one CSI socket; a refusal raises grpc.RpcError."""

    def __init__(self, endpoint: Path) -> None:
        self.endpoint = endpoint
        self._channel = grpc.insecure_channel(f"unix://{endpoint}")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CsiClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def identity(self, method: str, request: Any, response: Any) -> Any:
        return _call(self._channel, f"/{IDENTITY}/{method}", request, response)

    def node(self, method: str, request: Any, response: Any) -> Any:
        return _call(self._channel, f"/{NODE}/{method}", request, response)

    def probe(self) -> bool:
        response = self.identity("Probe", messages.ProbeRequest(), messages.ProbeResponse)
        return bool(response.ready.value)

    def publish(
        self,
        target: Path,
        attributes: dict[str, str],
        pod_namespace: str,
        pod_name: str,
        pod_uid: str,
        *,
        volume: str = "kvpool",
        ephemeral: bool = True,
        block: bool = False,
        readonly: bool = False,
    ) -> None:
        """NodePublishVolume as the kubelet sends it for an inline volume of a pod (a
        CSIDriver with podInfoOnMount); the target's parent is made first, as the kubelet
        does."""
        target.parent.mkdir(parents=True, exist_ok=True)
        context = dict(attributes)
        context.update(
            {
                EPHEMERAL: "true" if ephemeral else "false",
                POD_NAMESPACE: pod_namespace,
                POD_NAME: pod_name,
                POD_UID: pod_uid,
                SERVICE_ACCOUNT: "default",
            }
        )
        self.publish_volume(
            volume_id(pod_uid, volume), str(target), context, readonly=readonly, block=block
        )

    def publish_volume(
        self,
        volume: str,
        target: str,
        context: dict[str, str],
        *,
        readonly: bool = False,
        block: bool = False,
    ) -> None:
        """NodePublishVolume of the volume id ``volume`` at ``target`` (a path as the plugin
        sees it), with ``context`` as the volume context, as is."""
        request = messages.NodePublishVolumeRequest(
            volume_id=volume, target_path=target, readonly=readonly, volume_context=context
        )
        if block:
            request.volume_capability.block.SetInParent()
        else:
            request.volume_capability.mount.SetInParent()
        request.volume_capability.access_mode.mode = 1  # SINGLE_NODE_WRITER
        self.node("NodePublishVolume", request, messages.NodePublishVolumeResponse)

    def unpublish(self, target: Path, pod_uid: str, volume: str = "kvpool") -> None:
        self.unpublish_volume(volume_id(pod_uid, volume), str(target))

    def unpublish_volume(self, volume: str, target: str) -> None:
        """NodeUnpublishVolume of the volume id ``volume`` at ``target``."""
        request = messages.NodeUnpublishVolumeRequest(volume_id=volume, target_path=target)
        self.node("NodeUnpublishVolume", request, messages.NodeUnpublishVolumeResponse)
