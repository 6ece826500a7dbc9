"""Drive real vLLM engines (one process each, see :mod:`.engine_main`) for the connector tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from kvpool_agent.testing.agent_process import ENGINE_TOKEN

from .greedy import Candidates, problems

MAIN = Path(__file__).with_name("engine_main.py")
ROOT = Path(__file__).resolve().parents[2]
MARK = "@@"

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""A Llama small enough to start in seconds; head size 64 (a CPU attention size)."""


def write_model(directory: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny Llama with random weights: config.json and model.safetensors.

    Not vLLM's ``load_format="dummy"``: its weights are so small that greedy output
    ignores the context, and a test of loaded KV must see wrong KV change the output.
    Attention weights are large enough that attention is sharp and content-driven.
    """
    import torch
    from safetensors.torch import save_file

    config = {**TINY_LLAMA, **overrides}
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": normal(config["vocab_size"], hidden, std=0.1),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": normal(hidden, hidden, std=0.15),
            prefix + "self_attn.k_proj.weight": normal(kv, hidden, std=0.15),
            prefix + "self_attn.v_proj.weight": normal(kv, hidden, std=0.1),
            prefix + "self_attn.o_proj.weight": normal(hidden, hidden, std=0.1),
            prefix + "mlp.gate_proj.weight": normal(inner, hidden, std=0.05),
            prefix + "mlp.up_proj.weight": normal(inner, hidden, std=0.05),
            prefix + "mlp.down_proj.weight": normal(hidden, inner, std=0.05),
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def poison_segment(path: Path) -> None:
    """Overwrite every chunk byte of the agent's segment at ``path`` with bf16 noise: the
    negative control of a test that compares outputs computed from loaded KV."""
    import torch

    from kvpool_agent.segment import SharedSegment

    segment = SharedSegment.attach(path)
    try:
        layout = segment.layout
        noise = torch.randn(layout.data_size // 2, generator=torch.Generator().manual_seed(0))
        raw = noise.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        segment.view[layout.data_offset : layout.data_offset + layout.data_size] = raw
    finally:
        segment.close()


@dataclass
class Result:
    tokens: list[list[int]]
    cached: list[int]
    seconds: float
    counters: dict[str, float]
    top: list[list[Candidates]] = field(default_factory=list)
    """Per request, per generated token: the best candidates and their log-probabilities."""

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
            "KVPOOL_TOKEN": ENGINE_TOKEN,  # every harness agent's engine token
            **self.env,
        }
        for name in ("KVPOOL_ENDPOINT", "KVPOOL_SEGMENT_PATH", "KVPOOL_CHUNK_TOKENS"):
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
