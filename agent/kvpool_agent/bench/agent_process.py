"""A ``kvpool-agent`` process for a benchmark: its own segment and state, free ports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

READY = re.compile(r"agent ready pool=\S+ zmq=(\S+) http=(\S+)")


class BenchAgent:
    """Starts at construction (it is a test fixture of sorts, not a component); ``close`` ends it.

    ``settings`` are AgentConfig fields as KVPOOL_* variable suffixes, e.g. ``{"L1_SIZE": "1GiB"}``.
    """

    def __init__(self, name: str, settings: dict[str, str]) -> None:
        self._state = tempfile.TemporaryDirectory()
        self.segment = Path("/dev/shm") / f"kvpool-bench-{name}-{os.getpid()}"
        defaults = {
            "SEGMENT_PATH": str(self.segment),
            "ZMQ_PORT": "0",
            "HTTP_PORT": "0",
            "EVENTS_PORT": "0",
            "STATE_DIR": self._state.name,
        }
        env = {f"KVPOOL_{field}": value for field, value in {**defaults, **settings}.items()}
        self.process = subprocess.Popen(
            [Path(sys.executable).parent / "kvpool-agent"],
            env={**os.environ, **env},
            stderr=subprocess.PIPE,
            text=True,
        )
        self.endpoint, self.http = self._wait_ready()

    def _wait_ready(self) -> tuple[str, str]:
        found: list[tuple[str, str]] = []
        ready = threading.Event()

        def read() -> None:
            assert self.process.stderr is not None
            for line in self.process.stderr:
                match = READY.search(line)
                if match:
                    found.append((match.group(1), match.group(2)))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(60) or not found:
            self.close()
            raise RuntimeError("kvpool-agent did not start")
        return found[0]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self.segment.unlink(missing_ok=True)
        self._state.cleanup()
