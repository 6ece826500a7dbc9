"""A real ``kvpool-agent`` process for a test: the benches' agent
(:mod:`kvpool.tools.bench.local.agent_process`) with what only tests ask of it: tokens
it generates itself, a file limit and a umask, a start held until the test knows its PID,
a start that must fail, its memory, its ports kept across a restart. ``running_agent`` is
the benches' own, for a test that asks nothing more of its agent."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvpool.tools.bench.local.agent_process import (
    ADMIN_TOKEN,
    BIN,
    ENGINE_TOKEN,
    INDEX_TOKEN,
    running_agent,
)
from kvpool.tools.bench.local.agent_process import AgentProcess as BenchAgent
from tests.support.metrics import memory_bytes

__all__ = ["ADMIN_TOKEN", "ENGINE_TOKEN", "INDEX_TOKEN", "AgentProcess", "running_agent"]


@dataclass
class AgentProcess(BenchAgent):
    """One agent; ``settings`` become KVPOOL_* environment variables."""

    file_limit: int | None = None
    """RLIMIT_NOFILE of the process (soft and hard), if not inherited."""
    umask: int | None = None
    """The process's umask, if not inherited."""
    generate_tokens: bool = False
    """No tokens file: the agent generates its tokens into its state directory (see
    :attr:`admin_token`)."""

    @property
    def admin_token(self) -> str:
        """The admin token: the tokens file's, or the one the agent generated."""
        if not self.generate_tokens:
            return ADMIN_TOKEN
        state = Path(self.settings.get("STATE_DIR", self.workdir / "state"))
        return (state / f"admin-token-{self.settings.get('POOL', 'default')}").read_text().strip()

    def memory_bytes(self, field: str = "VmRSS") -> int:
        """``VmRSS`` (resident now) or ``VmHWM`` (the peak resident) of the agent, in bytes."""
        return memory_bytes(self.pid, field)

    def defaults(self) -> dict[str, str]:
        defaults = super().defaults()
        if self.generate_tokens:
            del defaults["TOKENS_FILE"]
        return defaults

    def launch(self, *, hold: bool = False) -> int:
        """Start the process without waiting for it; its PID. With ``hold``, it waits for
        :meth:`release` before it becomes the agent (same PID): the PID is known first."""
        within = self.within
        agent = str(BIN / "kvpool-agent")
        umask = -1 if self.umask is None else self.umask
        if self.file_limit is None and not hold:
            return self.spawn([*within, agent], umask=umask)
        # set in a launcher that then becomes the agent: preexec_fn is unsafe with threads
        steps = ["import os, resource, sys"]
        if self.file_limit is not None:
            limit = self.file_limit
            steps.append(f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))")
        if hold:
            steps.append("sys.stdin.readline()")
        steps.append("os.execv(sys.argv[1], sys.argv[1:])")
        launcher = [*within, sys.executable, "-c", "; ".join(steps), agent]
        return self.spawn(launcher, umask=umask, stdin=subprocess.PIPE if hold else None)

    def release(self) -> None:
        """Let a process launched with ``hold`` become the agent."""
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write("go\n")
        self._process.stdin.close()

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

    def fix_ports(self) -> None:
        """Keep the current ports across a restart (clients reconnect to the same address)."""
        self.settings["ZMQ_PORT"] = self.zmq.rsplit(":", 1)[1]
        self.settings["HTTP_PORT"] = self.http.rsplit(":", 1)[1]
