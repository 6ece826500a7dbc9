"""A local S3 endpoint: moto's standalone server in a subprocess, on 127.0.0.1 by default."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import subprocess
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def moto_server(startup_seconds: float = 30.0, host: str = "127.0.0.1") -> Iterator[str]:
    """Yields the endpoint URL of a fresh server listening on ``host`` (another address of
    this machine's: the root namespace's on the bridge of :mod:`.hosts`, so that agents
    on the hosts reach it); stops it on exit."""
    if importlib.util.find_spec("moto") is None:  # the server runs in this interpreter
        raise RuntimeError("a local S3 server needs moto: pip install 'moto[server]'")
    with socket.socket() as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + startup_seconds
        while True:  # no readiness signal to wait on: poll the port
            if process.poll() is not None:
                raise RuntimeError(f"moto server exited with status {process.returncode}")
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"moto server not up in {startup_seconds} s") from None
                time.sleep(0.05)
        yield f"http://{host}:{port}"
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
