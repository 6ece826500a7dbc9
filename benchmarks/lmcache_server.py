"""LMCache's multiprocess server on loopback, and a request client for it (the peer
measured by ``benchmarks/lmcache_peer.py``, in the same separate virtual environment)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHUNK_TOKENS = 256  # LMCache's default --chunk-size (tokens per chunk)
RPC_TIMEOUT = 60.0

NO_TRACKING = {
    # LMCache reports usage to its own collector unless told not to; stay on loopback.
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}


def lmcache_client(endpoint: str) -> tuple[Any, Any]:
    """A ZMQ request client for the MP server, and the ZMQ context that owns its socket."""
    import zmq
    from lmcache.v1.multiprocess.transport.factory import (  # type: ignore[import-not-found, unused-ignore]
        RequestClientFactory,
    )

    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    return RequestClientFactory.create(endpoint, context=context), context


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class LMCacheServer:
    """``lmcache server`` on loopback, engine-driven transfer, L1 in a /dev/shm pool."""

    def __init__(self, l1_bytes: int, workers: int, path: str, prefault: bool) -> None:
        self.port, http_port = _free_port(), _free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.shm_path: Path | None = None
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in close()
            prefix="lmcache-peer-", suffix=".log", delete=False
        )
        l1_gb = math.ceil(l1_bytes / (1 << 30) * 4) / 4
        launcher = Path(sys.executable).parent / "lmcache"  # the venv's console script
        self.command = [
            *([str(launcher)] if launcher.exists() else [sys.executable, "-m", "lmcache.cli.main"]),
            "server",
            "--host=127.0.0.1",
            f"--port={self.port}",
            "--http-host=127.0.0.1",
            f"--http-port={http_port}",
            f"--chunk-size={CHUNK_TOKENS}",
            "--supported-transfer-mode=engine_driven",
            f"--l1-size-gb={l1_gb}",
            "--no-l1-use-lazy",
            "--eviction-policy=LRU",
            f"--max-workers={workers}",
            "--disable-metrics",  # no Prometheus listener on 0.0.0.0:9090
        ]
        if path == "shm":
            name = f"kvpool_peer_{os.getpid()}"
            self.command.append(f"--shm-name={name}")
            self.shm_path = Path("/dev/shm") / f"lmcache_l1_pool_{name}"
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **NO_TRACKING},
            start_new_session=True,
        )
        self.prefaulted = False
        try:
            self._wait_ready(120.0)
            if prefault and self.shm_path is not None:
                self._prefault()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        req_client, context = lmcache_client(self.endpoint)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"lmcache server exited: {self.tail()}")
                with contextlib.suppress(TimeoutError):
                    if req_client.noop().result(timeout=1.0) == "OK":
                        tokens = req_client.get_chunk_size().result(timeout=RPC_TIMEOUT)
                        if int(tokens) != CHUNK_TOKENS:
                            raise RuntimeError(f"server chunk size {tokens} != {CHUNK_TOKENS}")
                        return
            raise RuntimeError(f"lmcache server not ready in {timeout:.0f}s: {self.tail()}")
        finally:
            req_client.close()
            context.term()

    def _prefault(self) -> None:
        """Allocate the pool's tmpfs pages up front, as kvpool's agent does for its segment."""
        assert self.shm_path is not None
        fd = os.open(self.shm_path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.prefaulted = True

    def clear(self) -> None:
        req_client, context = lmcache_client(self.endpoint)
        try:
            req_client.clear(True).result(timeout=RPC_TIMEOUT)
        finally:
            req_client.close()
            context.term()

    def tail(self, lines: int = 15) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").splitlines()
        return " | ".join(line.strip() for line in text[-lines:])

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


# ---------------------------------------------------------------- the run
