"""The CSI Identity service: the driver's name and version, no plugin capabilities (no
controller service: the plugin publishes inline ephemeral volumes only), always ready."""

from __future__ import annotations

from typing import Any

import grpc

from kvpool import __version__
from kvpool.common.names import CSI_DRIVER
from kvpool.csi import messages
from kvpool.csi.rpc import Method, service

SERVICE = "csi.v1.Identity"


def _info(_request: Any) -> Any:
    return messages.GetPluginInfoResponse(name=CSI_DRIVER, vendor_version=__version__)


def _capabilities(_request: Any) -> Any:
    return messages.GetPluginCapabilitiesResponse()


def _probe(_request: Any) -> Any:
    response = messages.ProbeResponse()
    response.ready.value = True
    return response


def identity() -> grpc.GenericRpcHandler:
    return service(
        SERVICE,
        [
            Method("GetPluginInfo", messages.GetPluginInfoRequest, _info),
            Method("GetPluginCapabilities", messages.GetPluginCapabilitiesRequest, _capabilities),
            Method("Probe", messages.ProbeRequest, _probe),
        ],
    )
