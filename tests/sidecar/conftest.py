"""A real ``kvpool-pd-sidecar`` process in front of fake vLLM servers: the decode pod's own
(``decode``) and a prefill pod's (``prefill``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sidecar.fake_vllm import FakeVllm
from tests.support.polling import wait_until
from tests.support.ports import free_port

KEY = b"k" * 32
NODE = "node-b"
"""The decode pod's node (``--node``)."""
PREFILL_TIMEOUT_S = 1.0
DECODE_WAIT_MS = 1500
MAX_BODY_BYTES = 64 << 10


class Sidecar:
    def __init__(self, workdir: Path, decode: FakeVllm, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"sidecar-{self.port}.log"
        command = [
            sys.executable,
            "-m",
            "kvpool.sidecar",
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--vllm={decode.url}",
            f"--node={NODE}",
            f"--prefill-timeout-s={PREFILL_TIMEOUT_S}",
            f"--decode-wait-ms={DECODE_WAIT_MS}",
            f"--max-body-bytes={MAX_BODY_BYTES}",
            *flags,
        ]
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, env=environment)
        wait_until(self._listening, timeout=20, what=f"the sidecar on {self.port}")

    def _listening(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        self.process.terminate()
        assert self.process.wait(10) == 0, self.log.read_text()
        assert "Traceback" not in self.log.read_text(), self.log.read_text()


@pytest.fixture(scope="module")
def decode() -> Iterator[FakeVllm]:
    server = FakeVllm()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prefill() -> Iterator[FakeVllm]:
    server = FakeVllm()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def fresh(decode: FakeVllm, prefill: FakeVllm) -> None:
    decode.reset()
    prefill.reset()


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory, decode: FakeVllm) -> Iterator[Sidecar]:
    """A sidecar with the pool's key, llm-d's header not followed."""
    workdir = tmp_path_factory.mktemp("signed")
    key_file = workdir / "key"
    key_file.write_bytes(KEY + b"\n")
    sidecar = Sidecar(workdir, decode, f"--key-file={key_file}")
    yield sidecar
    sidecar.stop()


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory, decode: FakeVllm) -> Iterator[Sidecar]:
    """A sidecar without a key, following llm-d's header."""
    sidecar = Sidecar(tmp_path_factory.mktemp("keyless"), decode, "--llmd-header-compat")
    yield sidecar
    sidecar.stop()
