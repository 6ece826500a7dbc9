"""Run a real ``kvpool-agent`` process for a bench: start, read its endpoints, stop, kill.

A private agent of this machine: ports the kernel picks on 127.0.0.1 (or on its host's
address, :mod:`.hosts`), its segment and state of its own, a tokens file with the tokens
below and its tenants and shared spaces. The repository's tests extend it
(``tests/support/agent_process.py``: limits, umask, a refused start).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import yaml

from kvpool.common.names import DOOR_SUFFIX
from kvpool.tools.bench.local.hosts import Host

BIN = Path(sys.executable).parent
READY = re.compile(r"agent ready pool=\S+ zmq=(\S+) http=(\S+) segment=(\S+) events=(\S+)")
ADMIN_TOKEN = "admin-token-for-tests-3f9c1a7e5b2d8064"
ENGINE_TOKEN = "engine-token-for-tests-a41e7c09d53b62f8"
INDEX_TOKEN = "index-token-for-tests-5d27b8e14c90fa36"
"""The tokens of every such agent's tokens file (with its tenants' own); the same in every
process (a bench's child processes use them too)."""


@dataclass
class AgentProcess:
    """One agent; ``settings`` become KVPOOL_* environment variables."""

    workdir: Path
    settings: dict[str, str] = field(default_factory=dict)
    tenant_tokens: dict[str, str] = field(default_factory=dict)
    spaces: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """Shared spaces of the tokens file: space id -> {members: [...], owners: [...]}."""
    host: Host | None = None
    """The host (network namespace) the agent runs in, serving at the host's address;
    else this machine's network, at 127.0.0.1. Its files stay in /dev/shm (shared)."""
    environment: dict[str, str] = field(default_factory=dict)
    """More of its environment, as is (not settings: the transfer engine's, say)."""
    zmq: str = ""
    http: str = ""
    events: str = ""
    log: list[str] = field(default_factory=list)
    _process: subprocess.Popen[str] | None = None
    _reader: threading.Thread | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _started: bool = False

    @property
    def segment_path(self) -> Path:
        """``SEGMENT_PATH`` of the settings, else a file of this process's in /dev/shm."""
        if "SEGMENT_PATH" in self.settings:
            return Path(self.settings["SEGMENT_PATH"])
        return Path("/dev/shm") / f"kvpool-bench-{os.getpid()}-{self.workdir.name}"

    @property
    def files(self) -> list[Path]:
        """The agent's files in /dev/shm: the segment, its probe table, its owner lock, and
        the directories of its chunk files and of its door."""
        segment = self.segment_path
        ends = (".probe", ".lock", ".files", DOOR_SUFFIX)
        return [segment, *(segment.with_name(segment.name + end) for end in ends)]

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def tokens(self) -> dict[str, object]:
        """The tokens file's content."""
        return {
            "admins": ADMIN_TOKEN,
            "engines": ENGINE_TOKEN,
            "indexes": INDEX_TOKEN,
            "tenants": dict(self.tenant_tokens),
            "spaces": dict(self.spaces),
        }

    def defaults(self) -> dict[str, str]:
        """The settings the agent gets unless :attr:`settings` names them (its tokens file
        written)."""
        tokens = self.workdir / "tokens.yaml"
        tokens.write_text(yaml.safe_dump(self.tokens()))
        host = {} if self.host is None else {"HOST": self.host.address}
        return {
            **host,
            "SEGMENT_PATH": str(self.segment_path),
            "L1_SIZE": "64Mi",
            "ZMQ_PORT": "0",
            "HTTP_PORT": "0",
            "EVENTS_PORT": "0",
            "STATE_DIR": str(self.workdir / "state"),
            "TOKENS_FILE": str(tokens),
        }

    def process_environment(self) -> dict[str, str]:
        merged = {**self.defaults(), **self.settings}
        settings = {f"KVPOOL_{name}": value for name, value in merged.items()}
        return {**os.environ, **self.environment, **settings}

    def start(self, timeout: float = 30.0) -> Self:
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> int:
        """Start the process without waiting for it; its PID."""
        return self.spawn([*self.within, str(BIN / "kvpool-agent")])

    @property
    def within(self) -> list[str]:
        """The command prefix that runs a program in the agent's host (none: here)."""
        return [] if self.host is None else self.host.prefix

    def spawn(self, command: list[str], **options: Any) -> int:
        """Start ``command`` (the agent, or what becomes it), reading its log; its PID.
        ``options`` go to ``subprocess.Popen``."""
        self._ready, self._started = threading.Event(), False
        self._process = subprocess.Popen(
            command, env=self.process_environment(), stderr=subprocess.PIPE, text=True, **options
        )
        self._reader = threading.Thread(
            target=self._read_log, args=(self._process, self._ready), daemon=True
        )
        self._reader.start()
        return self._process.pid

    def wait_ready(self, timeout: float = 30.0) -> Self:
        if not self._ready.wait(timeout) or not self._started:  # timed out, or it exited
            self.kill()
            raise RuntimeError("agent did not become ready:\n" + "".join(self.log))
        return self

    def _read_log(self, process: subprocess.Popen[str], ready: threading.Event) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            self.log.append(line)
            match = READY.search(line)
            if match:
                self.zmq, self.http, self.events = match.group(1), match.group(2), match.group(4)
                self._started = True
                ready.set()
        ready.set()  # exited: wake the waiter, which then finds no endpoints

    def stop(self, timeout: float = 15.0) -> int:
        assert self._process is not None
        self._process.send_signal(signal.SIGTERM)
        return self._process.wait(timeout)

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def cleanup(self) -> None:
        """Kill the agent and remove its files in /dev/shm (a killed agent leaves them all)."""
        self.kill()
        for path in self.files:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


@contextlib.contextmanager
def running_agent(
    settings: dict[str, str],
    timeout: float = 60.0,
    tenant_tokens: dict[str, str] | None = None,
) -> Iterator[AgentProcess]:
    """A started agent with its state in a temporary directory, removed with it on exit
    (``tenant_tokens``: tenant id -> token, in its tokens file)."""
    with tempfile.TemporaryDirectory(prefix="kvpool-agent-") as workdir:
        agent = AgentProcess(Path(workdir), dict(settings), dict(tenant_tokens or {}))
        try:
            yield agent.start(timeout)
        finally:
            agent.cleanup()
