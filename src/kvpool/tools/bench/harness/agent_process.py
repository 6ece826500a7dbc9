"""Run a real ``kvpool-agent`` process: start, read its endpoints, restart, kill."""

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

import yaml

from kvpool.common.names import DOOR_SUFFIX
from kvpool.tools.bench.harness.hosts import Host

BIN = Path(sys.executable).parent
READY = re.compile(r"agent ready pool=\S+ zmq=(\S+) http=(\S+) segment=(\S+) events=(\S+)")
ADMIN_TOKEN = "admin-token-for-tests-3f9c1a7e5b2d8064"
ENGINE_TOKEN = "engine-token-for-tests-a41e7c09d53b62f8"
INDEX_TOKEN = "index-token-for-tests-5d27b8e14c90fa36"
"""The tokens of every harness agent's tokens file (with its tenants' own)."""


@dataclass
class AgentProcess:
    """One agent; ``settings`` become KVPOOL_* environment variables."""

    workdir: Path
    settings: dict[str, str] = field(default_factory=dict)
    tenant_tokens: dict[str, str] = field(default_factory=dict)
    spaces: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """Shared spaces of the tokens file: space id -> {members: [...], owners: [...]}."""
    zmq: str = ""
    http: str = ""
    events: str = ""
    log: list[str] = field(default_factory=list)
    file_limit: int | None = None
    """RLIMIT_NOFILE of the process (soft and hard), if not inherited."""
    umask: int | None = None
    """The process's umask, if not inherited."""
    host: Host | None = None
    """The host (network namespace) the agent runs in, serving at the host's address;
    else this machine's network, at 127.0.0.1. Its files stay in /dev/shm (shared)."""
    generate_tokens: bool = False
    """No tokens file: the agent generates its tokens into its state directory (see
    :attr:`admin_token`)."""
    _process: subprocess.Popen[str] | None = None
    _reader: threading.Thread | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _started: bool = False

    @property
    def segment_path(self) -> Path:
        """``SEGMENT_PATH`` of the settings, else a file of this process's in /dev/shm."""
        if "SEGMENT_PATH" in self.settings:
            return Path(self.settings["SEGMENT_PATH"])
        return Path("/dev/shm") / f"kvpool-harness-{os.getpid()}-{self.workdir.name}"

    @property
    def files(self) -> list[Path]:
        """The agent's files in /dev/shm: the segment, its probe table, its owner lock, and
        the directories of its chunk files and of its door."""
        segment = self.segment_path
        ends = (".probe", ".lock", ".files", DOOR_SUFFIX)
        return [segment, *(segment.with_name(segment.name + end) for end in ends)]

    @property
    def admin_token(self) -> str:
        """The admin token: the tokens file's, or the one the agent generated."""
        if not self.generate_tokens:
            return ADMIN_TOKEN
        state = Path(self.settings.get("STATE_DIR", self.workdir / "state"))
        return (state / f"admin-token-{self.settings.get('POOL', 'default')}").read_text().strip()

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def memory_bytes(self, field: str = "VmRSS") -> int:
        """A memory figure of the agent from ``/proc/PID/status``: ``VmRSS`` (resident now) or
        ``VmHWM`` (the peak resident), in bytes."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) << 10
        raise RuntimeError(f"no {field} for process {self.pid}")

    def environment(self) -> dict[str, str]:
        tokens = self.workdir / "tokens.yaml"
        tokens.write_text(
            yaml.safe_dump(
                {
                    "admins": ADMIN_TOKEN,
                    "engines": ENGINE_TOKEN,
                    "indexes": INDEX_TOKEN,
                    "tenants": dict(self.tenant_tokens),
                    "spaces": dict(self.spaces),
                }
            )
        )
        defaults = {
            "SEGMENT_PATH": str(self.segment_path),
            "L1_SIZE": "64Mi",
            "ZMQ_PORT": "0",
            "HTTP_PORT": "0",
            "EVENTS_PORT": "0",
            "STATE_DIR": str(self.workdir / "state"),
            "TOKENS_FILE": str(tokens),
        }
        if self.host is not None:
            defaults["HOST"] = self.host.address
        if self.generate_tokens:
            del defaults["TOKENS_FILE"]
        merged = {**defaults, **self.settings}
        return {**os.environ, **{f"KVPOOL_{name}": value for name, value in merged.items()}}

    def start(self, timeout: float = 30.0) -> AgentProcess:
        self.launch()
        return self.wait_ready(timeout)

    def launch(self, *, hold: bool = False) -> int:
        """Start the process without waiting for it; its PID. With ``hold``, it waits for
        :meth:`release` before it becomes the agent (same PID): the PID is known first."""
        self._ready, self._started = threading.Event(), False
        self._process = subprocess.Popen(
            self._command(hold),
            env=self.environment(),
            stdin=subprocess.PIPE if hold else None,
            stderr=subprocess.PIPE,
            text=True,
            umask=-1 if self.umask is None else self.umask,
        )
        self._reader = threading.Thread(
            target=self._read_log, args=(self._process, self._ready), daemon=True
        )
        self._reader.start()
        return self._process.pid

    def release(self) -> None:
        """Let a process launched with ``hold`` become the agent."""
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write("go\n")
        self._process.stdin.close()

    def wait_ready(self, timeout: float = 30.0) -> AgentProcess:
        if not self._ready.wait(timeout) or not self._started:  # timed out, or it exited
            self.kill()
            raise RuntimeError("agent did not become ready:\n" + "".join(self.log))
        return self

    def wait_refused(self, timeout: float = 30.0) -> int:
        """Wait for an agent that must not start to exit; its exit status (stderr in ``log``).

        AssertionError (and the agent killed) if it became ready instead.
        """
        assert self._process is not None and self._reader is not None
        self._ready.wait(timeout)
        if self._started:
            self.kill()
            raise AssertionError("the agent started:\n" + "".join(self.log))
        status = self._process.wait(timeout)
        self._reader.join(timeout)
        return status

    def _command(self, hold: bool = False) -> list[str]:
        within = [] if self.host is None else self.host.prefix
        agent = str(BIN / "kvpool-agent")
        if self.file_limit is None and not hold:
            return [*within, agent]
        # set in a launcher that then becomes the agent: preexec_fn is unsafe with threads
        steps = ["import os, resource, sys"]
        if self.file_limit is not None:
            limit = self.file_limit
            steps.append(f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))")
        if hold:
            steps.append("sys.stdin.readline()")
        steps.append("os.execv(sys.argv[1], sys.argv[1:])")
        return [*within, sys.executable, "-c", "; ".join(steps), agent]

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

    def fix_ports(self) -> None:
        """Keep the current ports across a restart (clients reconnect to the same address)."""
        self.settings["ZMQ_PORT"] = self.zmq.rsplit(":", 1)[1]
        self.settings["HTTP_PORT"] = self.http.rsplit(":", 1)[1]

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
