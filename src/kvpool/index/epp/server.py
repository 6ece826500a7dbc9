"""The endpoint picker's gRPC server: Envoy's ext_proc service and gRPC health.

Anyone who reaches the port may talk to it (ext_proc has no authentication; a
NetworkPolicy says who can connect), so what one peer can hold is bounded:

- ``max_streams`` streams at once over all connections (each is one request through the
  gateway, from its headers to its response's end, and holds one worker thread); past
  it gRPC refuses the stream (RESOURCE_EXHAUSTED: Envoy fails the request, or lets it
  through unrouted when failure_mode_allow);
- a message of at most ``max_body_bytes`` + 1 MiB, a body of at most ``max_body_bytes``
  per stream (413) and ``body_budget_bytes`` over all streams (503);
- a stream must finish its request (headers and body) within ``request_seconds`` of
  opening, and once routed may stay silent at most ``idle_seconds`` between messages
  (a response the engine takes that long to start), or it is cancelled.

What one peer can cost, then: all ``max_streams`` threads (other streams are refused
until its streams end or time out: the picker's own denial of service, hence the
NetworkPolicy), ``body_budget_bytes`` of bodies the edge holds, and what gRPC buffers
of messages not yet delivered (bounded by HTTP/2 flow control and, per message, by the
receive limit). A pick's own time is the picker core's deadline; tokenizing a text
prompt is bounded by ``max_body_bytes`` of text.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvpool.common.auth import Role, TokenAuthority
from kvpool.common.index_config import PickerConfig
from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.index.epp.prefill import PrefillHeaders
from kvpool.index.epp.stream import Answers, BodyBudget, Limits, Phase, Stream
from kvpool.index.picking import Picker
from kvpool.index.prompts import Prompts

log = logging.getLogger(__name__)
_rare = RateLimitedLog(log)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
"""The names gRPC health answers SERVING for (GAIE's Envoy checks the ext_proc one)."""


@dataclass
class _Watched:
    context: Any
    deadline: float


class _Watchdog:
    """Cancels streams past their deadline, checked every ``period`` seconds."""

    def __init__(self, period: float = 0.5) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, _Watched] = {}
        self._stop = threading.Event()
        self._period = period
        self._thread = threading.Thread(target=self._run, name="epp-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def watch(self, key: int, context: Any, deadline: float) -> None:
        with self._lock:
            self._streams[key] = _Watched(context, deadline)

    def forget(self, key: int) -> None:
        with self._lock:
            self._streams.pop(key, None)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            now = time.monotonic()
            with self._lock:
                late = [key for key, watched in self._streams.items() if watched.deadline < now]
                contexts = [self._streams.pop(key).context for key in late]
            for context in contexts:
                context.cancel()
            if contexts:
                _rare.warning(f"cancelled {len(contexts)} ext_proc stream(s) past their deadline")


class _ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, server: EppServer) -> None:
        self._server = server

    def Process(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        server = self._server
        if server.authority is not None and not _gateway(server.authority, context):
            server.answers.count(401, "unauthenticated")
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "the endpoint picker takes a gateway or admin token of the pool "
                "(authorization: Bearer ... in the gRPC service's initial metadata)",
            )
        stream = Stream(
            server.picker,
            server.prompts,
            server.limits,
            server.answers,
            server.budget,
            prefill=server.prefill,
        )
        key = id(stream)
        server.watchdog.watch(key, context, time.monotonic() + server.request_seconds)
        try:
            for request in requests:
                yield from stream.handle(request)
                if stream.finished:
                    return
                if stream.phase is Phase.PICKED:
                    server.watchdog.watch(key, context, time.monotonic() + server.idle_seconds)
        except grpc.RpcError:
            pass  # cancelled: by Envoy, or by the watchdog
        except Exception:
            _rare.exception("an ext_proc stream failed")
        finally:
            server.watchdog.forget(key)
            stream.close()


def _gateway(authority: TokenAuthority, context: Any) -> bool:
    """Whether the stream's metadata carries a gateway's or an admin's bearer token."""
    for key, value in context.invocation_metadata():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            principal = authority.authenticate(value.removeprefix("Bearer ").strip())
            return principal is not None and principal.role in (Role.GATEWAY, Role.ADMIN)
    return False


class EppServer:
    """Envoy's external processor in front of ``picker``, and gRPC health, on
    ``host``:``config.port``."""

    def __init__(
        self,
        picker: Picker,
        config: PickerConfig,
        host: str,
        prompts: Prompts | None,
        *,
        max_streams: int = 1024,
        body_budget_bytes: int = 256 << 20,
        request_seconds: float = 60.0,
        idle_seconds: float = 3600.0,
        authority: TokenAuthority | None = None,
        prefill_key: bytes | None = None,
    ) -> None:
        """``authority``: streams must carry one of its gateway or admin tokens (checked
        before anything of the stream is read); None: no token asked. ``prefill_key``: the
        pool's disaggregation key (``picker.pd``), which signs the prefill pods picked."""
        self.picker = picker
        self.authority = authority
        self.prompts = prompts
        self.config = config
        self.host = host
        self.limits = Limits(int(config.max_body_bytes), config.max_prompt_tokens)
        self.answers = Answers()
        """The edge's answers by status and reason (for the index's metrics)."""
        self.budget = BodyBudget(body_budget_bytes)
        self.prefill = PrefillHeaders(prefill_key, config.pd)
        self.request_seconds = request_seconds
        self.idle_seconds = idle_seconds
        self.max_streams = max_streams
        self.watchdog = _Watchdog()
        self._server: grpc.Server | None = None

    def start(self) -> int:
        """Serve; the bound port (``config.port`` 0 picks a free one)."""
        message_bytes = self.limits.max_body_bytes + (1 << 20)
        server = grpc.server(
            ThreadPoolExecutor(max_workers=self.max_streams + 4, thread_name_prefix="epp"),
            maximum_concurrent_rpcs=self.max_streams,
            options=[
                ("grpc.max_receive_message_length", message_bytes),
                ("grpc.max_concurrent_streams", self.max_streams),
                ("grpc.so_reuseport", 0),
            ],
        )
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            _ExternalProcessor(self), server
        )
        health_servicer = health.HealthServicer()
        for name in HEALTH_SERVICES:
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        address = f"[{self.host}]" if ":" in self.host else self.host
        try:
            port = int(server.add_insecure_port(f"{address}:{self.config.port}"))
        except RuntimeError:  # grpcio's "Failed to bind" (taken, or no such address)
            port = 0
        if port == 0:
            raise OSError(
                f"the endpoint picker cannot listen on {address}:{self.config.port} "
                "(picker.port): in use, or not an address of this host"
            )
        self.watchdog.start()
        server.start()
        self._server = server
        log.info("endpoint picker (ext_proc) on %s:%d", address, port)
        return port

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving: streams get ``grace`` seconds, then are cancelled."""
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
            self.watchdog.stop()
