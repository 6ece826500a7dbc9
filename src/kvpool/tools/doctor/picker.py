"""The picker check: the pool's endpoint picker answers a gateway's health check.

A Gateway API Inference Extension gateway sends each request through the picker
(``spec.index.picker``, the ext_proc gRPC server in the index's pods, which an
InferencePool's ``endpointPickerRef`` names) and health-checks it with the standard gRPC
health service, asking for ``envoy.service.ext_proc.v3.ExternalProcessor``. This check asks
the same, within the doctor's timeout, of the index Service's picker port (read from the
index's ConfigMap, as the index reads it), or of ``--picker HOST:PORT``. SERVING passes;
anything else fails, in one line: a gateway with ``failureMode: FailOpen`` then routes
without the picker (no cache affinity), one with FailClose answers errors. Skipped for a
pool without an index or whose index serves no picker.
"""

from __future__ import annotations

from typing import Any

from kvpool.common.names import index_config_map_name, index_name
from kvpool.tools.doctor.kube import KubeReader, refusal
from kvpool.tools.doctor.report import Check, failed, passed, skipped

NAME = "picker"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
"""The service a gateway's health check names (GAIE's Envoy configuration does)."""
OFF = "the pool's index serves no endpoint picker (spec.index.picker.enabled is false)"


def check_picker(
    kube: KubeReader | None,
    pool: str | None,
    namespace: str | None,
    address: str | None,
    timeout: float,
) -> Check:
    """:func:`probe` ``address`` (``--picker``) if given, else the index Service at the
    picker port that the index's ConfigMap names."""
    if address is not None:
        return probe(address, timeout)
    if kube is None or pool is None or namespace is None:
        return skipped(NAME, "no pool: the picker's port is read from the index's ConfigMap")
    where = f"{namespace}/{index_config_map_name(pool)}"
    try:
        config: Any = kube.index_config(pool, namespace)
    except Exception as error:  # the Kubernetes client raises many kinds
        why = refusal(error)
        if why.status == 404:
            return skipped(NAME, f"the pool has no index (no ConfigMap {where})")
        return skipped(NAME, f"cannot read the index's ConfigMap {where}: {why.message}")
    picker = config.get("picker") if isinstance(config, dict) else None
    if not isinstance(picker, dict) or not picker.get("enabled"):
        return skipped(NAME, OFF)
    port = picker.get("port")
    if not isinstance(port, int) or not 0 < port < 65536:
        return failed(NAME, f"the picker's port in {where} is {port!r}", _FIX_PORT)
    return probe(f"{index_name(pool)}.{namespace}.svc:{port}", timeout)


def probe(target: str, timeout: float) -> Check:
    """Ask ``target`` (host:port) the gRPC health of the ext_proc service, as a gateway
    does, over cleartext HTTP/2; one line whatever goes wrong. gRPC comes with the index's
    install (kvpool[index]); where the doctor runs without it, the check is skipped."""
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped,unused-ignore]
    except ImportError as missing:
        return skipped(NAME, f"no gRPC here ({missing.name}): pip install 'kvpool[index]'")
    request = health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE)
    try:
        with grpc.insecure_channel(target) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
    except grpc.RpcError as error:
        code = error.code()
        details = " ".join(str(error.details() or "").split())
        return failed(
            NAME,
            f"the endpoint picker at {target} does not answer its health check within "
            f"{timeout:g} s: {code.name if code else 'UNKNOWN'}"
            + (f": {details}" if details else ""),
            _FIX_UNREACHABLE,
        )
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    if answer.status != health_pb2.HealthCheckResponse.SERVING:
        return failed(
            NAME,
            f"the endpoint picker at {target} answers {status} for {EXT_PROC_SERVICE}",
            "it is starting, or finds no model server: see the index's log (kubectl logs "
            "deploy/kvpool-<pool>-index) and spec.index.picker.selector",
        )
    return passed(NAME, f"the endpoint picker at {target} is {status} ({EXT_PROC_SERVICE})")


_FIX_UNREACHABLE = (
    "is the index running (kubectl get deploy kvpool-<pool>-index), and does "
    "spec.networkPolicy.pickerClients admit this pod? Until it answers, gateways route "
    "without it (failureMode FailOpen) or fail (FailClose)"
)
_FIX_PORT = "the operator writes it from spec.index.picker.port: re-apply the KVCachePool"
