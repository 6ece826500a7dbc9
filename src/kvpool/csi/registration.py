"""The kubelet's plugin registration: the socket its plugin watcher finds in the
registration directory, which names the driver and where the kubelet reaches its CSI
socket."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc

from kvpool.common.names import CSI_DRIVER
from kvpool.csi import messages
from kvpool.csi.rpc import Method, service

log = logging.getLogger(__name__)

SERVICE = "pluginregistration.Registration"
PLUGIN_TYPE = "CSIPlugin"
SUPPORTED_VERSIONS = ("1.0.0",)


def registration_socket(registration_dir: Path) -> Path:
    """The socket the kubelet's plugin watcher discovers in ``registration_dir``."""
    return registration_dir / f"{CSI_DRIVER}-reg.sock"


def registration(kubelet_endpoint: str) -> grpc.GenericRpcHandler:
    """The Registration service of a plugin the kubelet reaches at ``kubelet_endpoint``
    (the CSI socket's path on the node)."""

    def info(_request: Any) -> Any:
        return messages.PluginInfo(
            type=PLUGIN_TYPE,
            name=CSI_DRIVER,
            endpoint=kubelet_endpoint,
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    def notified(status: Any) -> Any:
        if not status.plugin_registered:
            log.error("the kubelet did not register %s: %s", CSI_DRIVER, status.error)
        return messages.RegistrationStatusResponse()

    return service(
        SERVICE,
        [
            Method("GetInfo", messages.InfoRequest, info),
            Method(
                "NotifyRegistrationStatus",
                messages.RegistrationStatus,
                notified,
                lambda status: f"registered={status.plugin_registered}",
            ),
        ],
    )
