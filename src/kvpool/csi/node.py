"""The CSI Node service: publishes a pool's directory into a pod as an inline ephemeral
volume (a bind mount onto the pod's volume directory), and unpublishes it.

What a pod gets depends on its namespace, as the kubelet names it in the volume context
(``csi.storage.k8s.io/pod.namespace``, from ``podInfoOnMount``; never an attribute the pod
sets): a pod of one of the pool's ``engineNamespaces`` gets the pool's whole directory (its
segment, the probe table that lists every tenant's keys on the node, the lock and the door),
read-only if the kubelet asks; any other pod gets only the directory's door
(``segment.door/``), always read-only, where the agent's door socket hands a connector the
chunk files its token may map (connecting to a socket needs no write access to its mount,
nor any group).

A publish is checked in order: the request's own fields (an ephemeral mount volume with
the pool's attributes and the pod's namespace, a target in a pod's volume directory), then
the pool and its Service (:mod:`~kvpool.csi.pool_access`), then the pool's directory
(and door) on the node: one that does not exist yet (the agent has not started) is
UNAVAILABLE, which the kubelet retries. Publishing the same directory to the same target
again succeeds; unpublishing a target that is not there succeeds.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from kubernetes.client import CoreV1Api

from kvpool.common.names import CSI_NAMESPACE_ATTRIBUTE, CSI_POOL_ATTRIBUTE
from kvpool.csi import messages, mounts, paths, pool_access
from kvpool.csi.rpc import Method, Refusal, service

log = logging.getLogger(__name__)

SERVICE = "csi.v1.Node"
EPHEMERAL = "csi.storage.k8s.io/ephemeral"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_UID = "csi.storage.k8s.io/pod.uid"
TARGET_MODE = 0o750

_INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass(frozen=True)
class NodeOptions:
    node_id: str
    kubelet_dir: Path
    """The kubelet's root directory, as this process sees it (targets lie in its pods/)."""
    shm_dir: Path
    """The node's shared memory, as this process sees it (pool directories lie in it)."""
    api: Callable[[], CoreV1Api]
    """A client of the Kubernetes API, for each publish."""
    api_timeout: float = 5.0


class Node:
    def __init__(self, options: NodeOptions) -> None:
        self.options = options
        self._lock = threading.Lock()  # one publish or unpublish at a time

    def handler(self) -> grpc.GenericRpcHandler:
        return service(
            SERVICE,
            [
                Method("NodeGetInfo", messages.NodeGetInfoRequest, self.info),
                Method(
                    "NodeGetCapabilities", messages.NodeGetCapabilitiesRequest, self.capabilities
                ),
                Method(
                    "NodePublishVolume", messages.NodePublishVolumeRequest, self.publish, _publish
                ),
                Method(
                    "NodeUnpublishVolume",
                    messages.NodeUnpublishVolumeRequest,
                    self.unpublish,
                    _unpublish,
                ),
            ],
        )

    def info(self, _request: Any) -> Any:
        return messages.NodeGetInfoResponse(node_id=self.options.node_id)

    def capabilities(self, _request: Any) -> Any:
        return messages.NodeGetCapabilitiesResponse()

    def publish(self, request: Any) -> Any:
        if not request.volume_id:
            raise Refusal(_INVALID, "no volume_id")
        _check_capability(request)
        context = request.volume_context
        ephemeral = context.get(EPHEMERAL, "")
        if ephemeral != "true":
            raise Refusal(
                _INVALID,
                f"volume {request.volume_id} is not an inline ephemeral volume "
                f"({EPHEMERAL}={ephemeral!r}): a pod asks for a pool with a csi volume",
            )
        pool = _attribute(context, CSI_POOL_ATTRIBUTE)
        namespace = _attribute(context, CSI_NAMESPACE_ATTRIBUTE)
        pod_namespace = context.get(POD_NAMESPACE, "")
        if not pod_namespace:
            raise Refusal(
                _INVALID,
                f"the kubelet sent no {POD_NAMESPACE}: the CSIDriver needs podInfoOnMount",
            )
        target = self._target(request.target_path)
        api = self.options.api()
        timeout = self.options.api_timeout
        found = pool_access.read_pool(api, pool, namespace, timeout)
        engine = pool_access.is_engine_namespace(found, pod_namespace)
        segment = pool_access.segment_path(api, pool, namespace, timeout)
        directory = self._directory(segment, pool, whole=engine)
        readonly = request.readonly or not engine
        with self._lock:
            _bind(directory, target, readonly=readonly)
        log.info(
            "published %s at %s (%s, %s) to a pod of namespace %s",
            directory,
            target,
            "the pool's directory: an engine namespace" if engine else "the door only",
            "read-only" if readonly else "read-write",
            pod_namespace,
        )
        return messages.NodePublishVolumeResponse()

    def unpublish(self, request: Any) -> Any:
        if not request.volume_id:
            raise Refusal(_INVALID, "no volume_id")
        target = self._target(request.target_path)
        with self._lock:
            try:
                while mounts.mounted_at(target) is not None:
                    mounts.unmount(target)
                with contextlib.suppress(FileNotFoundError):
                    target.rmdir()
            except OSError as error:
                raise Refusal(
                    grpc.StatusCode.INTERNAL, f"cannot unpublish {target}: {error.strerror}"
                ) from error
        return messages.NodeUnpublishVolumeResponse()

    def _target(self, target: str) -> Path:
        if not target:
            raise Refusal(_INVALID, "no target_path")
        try:
            return paths.target_path(target, self.options.kubelet_dir)
        except ValueError as error:
            raise Refusal(_INVALID, str(error)) from error

    def _directory(self, segment: str, pool: str, *, whole: bool) -> Path:
        """The pool's directory (``whole``), else its door only."""
        try:
            directory = paths.pool_directory(segment, self.options.shm_dir, pool)
            return directory if whole else paths.door_directory(directory)
        except FileNotFoundError as error:
            raise Refusal(
                grpc.StatusCode.UNAVAILABLE,
                f"{error}: the pool's agent has not started on this node yet",
            ) from error
        except ValueError as error:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from error


def _check_capability(request: Any) -> None:
    if not request.HasField("volume_capability"):
        raise Refusal(_INVALID, f"volume {request.volume_id} has no volume_capability")
    access = request.volume_capability.WhichOneof("access_type")
    if access != "mount":
        raise Refusal(
            _INVALID,
            f"volume {request.volume_id} asks for {access or 'no'} access: only mount is "
            "supported (a directory)",
        )


def _attribute(context: Any, name: str) -> str:
    value = context.get(name, "")
    if not isinstance(value, str) or not value:
        raise Refusal(_INVALID, f"the volume has no attribute {name!r}")
    return value


def _bind(directory: Path, target: Path, *, readonly: bool) -> None:
    """Bind ``directory`` onto ``target`` unless it is already there."""
    try:
        mounted = mounts.mounted_at(target)
        if mounted is not None:
            if not os.path.samestat(os.stat(target), os.stat(directory)):
                raise Refusal(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"target path {target} is already mounted with {mounted.source}"
                    f"{mounted.root if mounted.root != '/' else ''} ({mounted.fstype}), "
                    f"not {directory}",
                )
            wanted = mounts.PUBLISHED_OPTIONS | {"ro" if readonly else "rw"}
            if not wanted <= mounted.options:
                mounts.restrict(target, readonly=readonly)
            return
        with contextlib.suppress(FileExistsError):
            target.mkdir(mode=TARGET_MODE)
        mounts.bind(directory, target, readonly=readonly)
    except OSError as error:
        code = grpc.StatusCode.INTERNAL
        if error.errno == errno.ENOENT:
            code = grpc.StatusCode.FAILED_PRECONDITION
        raise Refusal(code, f"cannot publish {directory} at {target}: {error}") from error


def _publish(request: Any) -> str:
    context = request.volume_context
    return (
        f"volume={request.volume_id} target={request.target_path} "
        f"pool={context.get(CSI_NAMESPACE_ATTRIBUTE, '')}/{context.get(CSI_POOL_ATTRIBUTE, '')} "
        f"pod={context.get(POD_NAMESPACE, '')}/{context.get(POD_NAME, '')} "
        f"uid={context.get(POD_UID, '')} readonly={request.readonly}"
    )


def _unpublish(request: Any) -> str:
    return f"volume={request.volume_id} target={request.target_path}"
