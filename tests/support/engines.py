"""Drive real vLLM engines (one process each, see :mod:`.engine_main`) for the connector tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import Any

import pytest

from kvpool.common.names import CONNECTOR_OLD_NAMES, CONNECTOR_TOKEN_ENV
from tests.support.agent_process import ENGINE_TOKEN

from .greedy import Candidates, problems
from .models import TINY_LLAMA, write_model

__all__ = ["TINY_LLAMA", "Engine", "Result", "needs_fast_bf16", "poison_segment", "write_model"]

MAIN = Path(__file__).with_name("engine_main.py")
ROOT = Path(__file__).resolve().parents[2]
MARK = "@@"


def _fast_bf16() -> bool:
    """Whether this CPU computes bf16 at speed (AVX-512 bf16 or AMX instructions)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None


needs_fast_bf16 = pytest.mark.skipif(
    not _fast_bf16(),
    reason="runs a bench's bf16 model, and this CPU has no AVX-512 bf16 or AMX instructions "
    "(vLLM's CPU engine computes bf16 about 30 times slower without)",
)
"""For a test of ``kvpool bench`` that runs vLLM (its models are bf16, as the benched ones):
the engine tests' own models run in float32 (:mod:`.engine_main`), fast on any x86 CPU."""


def poison_segment(path: Path) -> None:
    """Overwrite every chunk byte of the agent of the segment at ``path`` (in every chunk
    file, where it holds memory) with bf16 noise: the negative control of a test that
    compares outputs computed from loaded KV."""
    import torch

    from kvpool.common.chunk_files import files_directory

    noise = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    raw = noise.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    for file in files_directory(path).glob("*/*.kv"):
        fd = os.open(file, os.O_RDWR)
        try:
            position = 0
            while True:
                try:
                    start = os.lseek(fd, position, os.SEEK_DATA)
                except OSError:
                    break  # no memory after position
                position = os.lseek(fd, start, os.SEEK_HOLE)
                for at in range(start, position, len(raw)):
                    os.pwrite(fd, raw[: min(len(raw), position - at)], at)
        finally:
            os.close(fd)


@dataclass
class Result:
    tokens: list[list[int]]
    cached: list[int]
    seconds: float
    counters: dict[str, float]
    top: list[list[Candidates]] = field(default_factory=list)
    """Per request, per generated token: the best candidates and their log-probabilities."""

    def only(self, index: int) -> Result:
        """The result of the ``index``-th request alone."""
        return Result(
            [self.tokens[index]],
            [self.cached[index]],
            self.seconds,
            self.counters,
            self.top[index : index + 1],
        )

    def differences(self, reference: Result) -> list[str]:
        """Why these generations are not the reference's up to numerical noise (see
        :mod:`.greedy`); empty if they are."""
        return problems(self.tokens, self.top, reference.tokens, reference.top)


@dataclass
class Engine:
    """A vLLM engine process; ``settings`` go to :func:`.engine_main.build`."""

    name: str
    settings: dict[str, Any]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    _process: subprocess.Popen[str] | None = None
    _lines: Queue[str] = field(default_factory=Queue)

    def start(self) -> Engine:
        environment = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout carries the results
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            CONNECTOR_TOKEN_ENV: ENGINE_TOKEN,  # every harness agent's engine token
            **self.env,
        }
        for new, old in CONNECTOR_OLD_NAMES.items():  # the shell's, by either name
            for name in (new, old) if new != CONNECTOR_TOKEN_ENV else (old,):
                if name not in self.env:
                    environment.pop(name, None)
        log = self.log_path.open("w")
        self._process = subprocess.Popen(
            [sys.executable, str(MAIN), json.dumps(self.settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=environment,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith(MARK):
                self._lines.put(line[len(MARK) :].rstrip("\n"))
        self._lines.put("exited")

    def _next(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except Empty:
            raise TimeoutError(f"engine {self.name} did not answer in {timeout} s") from None
        if line == "exited":
            raise RuntimeError(f"engine {self.name} exited; log:\n{self.log_tail()}")
        return line

    def wait_ready(self, timeout: float = 180.0) -> None:
        line = self._next(timeout)
        assert line == "ready", line

    def generate(
        self,
        prompts: list[list[int]],
        *,
        salts: list[str | None] | None = None,
        max_tokens: int = 8,
        timeout: float = 120.0,
    ) -> Result:
        assert self._process is not None and self._process.stdin is not None
        request = {"prompts": prompts, "salts": salts, "max_tokens": max_tokens}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        line = self._next(timeout)
        assert line.startswith("result "), line
        return Result(**json.loads(line.removeprefix("result ")))

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text()

    def key_fingerprint(self) -> dict[str, object]:
        """The key fingerprint the engine's connector logged."""
        found = re.search(r"key fingerprint for the index: (\{.*\})", self.log_text())
        assert found, "the connector logged no fingerprint"
        return json.loads(found.group(1))  # type: ignore[no-any-return]

    def stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        try:
            assert process.stdin is not None
            process.stdin.write(json.dumps({"op": "stop"}) + "\n")
            process.stdin.close()
            process.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
