"""Start a server process, wait (bounded) for its HTTP health endpoint, stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx


class StartupError(RuntimeError):
    """The process exited, or was not healthy in time; the message ends with its log."""


@dataclass
class HttpProcess:
    """``command`` in a session of its own, stdout and stderr to ``log_path``.

    The session lets :meth:`stop` reach the children the process started (vLLM's API
    server runs its engine core in a child process) if the process does not take them
    down itself.
    """

    name: str
    command: list[str]
    health_url: str
    log_path: Path
    env: Mapping[str, str | None] = field(default_factory=dict)
    """Changes to this process's environment: a value sets, None removes."""
    _process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> HttpProcess:
        """Start, and return once ``health_url`` answers 200; raise :class:`StartupError`
        (process stopped, log attached) if it exits first or ``timeout`` passes."""
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        started = time.monotonic()
        while True:
            code = self._process.poll()
            if code is not None:
                self.stop()
                raise StartupError(
                    self._failure(f"{self.name} exited with {code} before it was healthy")
                )
            if self.healthy():
                return self
            if time.monotonic() - started > timeout:
                self.stop()
                raise StartupError(self._failure(f"{self.name} was not healthy in {timeout:.0f} s"))
            time.sleep(0.5)

    @property
    def pid(self) -> int:
        """The process's id, which is also its session's and process group's."""
        assert self._process is not None, f"{self.name} was never started"
        return self._process.pid

    def environment(self) -> dict[str, str]:
        environment = dict(os.environ)
        for name, value in self.env.items():
            if value is None:
                environment.pop(name, None)
            else:
                environment[name] = value
        return environment

    def healthy(self) -> bool:
        try:
            return httpx.get(self.health_url, timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _failure(self, reason: str) -> str:
        return f"{reason}; {self.log_path}, last lines:\n{self.log_tail()}"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then after ``timeout`` SIGKILL to the whole session; waits for the
        process either way."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever the process left behind
        process.wait()
