"""A stand-in for a vLLM server's /metrics: a real HTTP server with vLLM's load gauges.

The gauges are made by ``prometheus_client`` (as vLLM makes them) with the names and labels
of ``vllm/v1/metrics/loggers.py``; the test sets each engine's values, the answer's status,
or a drip that sends the body one byte at a time.
"""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest


def vllm_metrics(engines: list[tuple[float, float, float]]) -> bytes:
    """/metrics of a vLLM server with one (waiting, running, kv usage) per engine."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    waiting = Gauge("vllm:num_requests_waiting", "Waiting.", labels, registry=registry)
    running = Gauge("vllm:num_requests_running", "Running.", labels, registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage.", labels, registry=registry)
    by_reason = Gauge(
        "vllm:num_requests_waiting_by_reason", "By reason.", [*labels, "reason"], registry=registry
    )
    for engine, (w, r, u) in enumerate(engines):
        values = ("org/model {x}", str(engine))  # a label value with a space and braces
        waiting.labels(*values).set(w)
        running.labels(*values).set(r)
        usage.labels(*values).set(u)
        by_reason.labels(*values, "capacity").set(1000)  # not the waiting gauge
    return generate_latest(registry)


class MetricsServer:
    """A real HTTP server answering GET /metrics with ``body`` (or ``status``), ``drip``
    seconds between bytes when set."""

    def __init__(self) -> None:
        self.body = vllm_metrics([(0, 0, 0)])
        self.status = 200
        self.drip = 0.0
        self.reads = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.reads += 1
                body = outer.body
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if outer.drip:
                    for byte in body:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(outer.drip)
                else:
                    self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                """Quiet."""

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
