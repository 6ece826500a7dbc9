"""The engines of ``kvpool bench connector``: one vLLM engine per child process, fed over pipes.

The parent sends one JSON object per line: ``{"prompt": ids}`` or ``{"prompt": ids,
"salt": cache_salt}`` (one request, ``max_tokens=1``, answered with a :class:`Sample`) or
``{"burst": [ids, ...]}`` (all prompts in one ``generate`` call, answered with a
:class:`Burst`). An engine started with ``time_steps`` times the connector's scheduler-side
calls per engine step (:class:`StepTimer`); the engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its scheduler is in this process. vLLM's prefix
cache is on in ``native`` and where the settings' ``prefix_caching`` says so.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.common import problems
from kvpool.common.names import CONNECTOR_OLD_NAMES, CONNECTOR_TOKEN_ENV

RESULT = "@@kvpool-bench "
NOT_MOUNTED = "/nonexistent/kvpool-segment"
"""The ``inline`` engine's segment path: no such file, so its KV travels in the agent's
messages."""
KVPOOL_METRIC = "vllm:kvpool_"
"""The connector's counters in vLLM's metrics: ``vllm:kvpool_<name>_us`` for its own time,
``vllm:kvpool_hit_tokens`` for the tokens it loaded."""
HEAD_SIZE = 64
SCHEDULER_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
"""The connector's methods that vLLM's scheduler calls."""


@dataclass(frozen=True)
class Sample:
    seconds: float
    cached: int
    token: int
    connector_us: dict[str, int]
    """The kvpool connector's own time on the request, per ``vllm:kvpool_<name>_us`` counter."""
    hit_tokens: int = 0
    """Of ``cached``, the tokens the kvpool connector loaded (its ``hit_tokens`` counter); the
    rest came from vLLM's own prefix cache."""

    def spent_us(self, name: str) -> int:
        return self.connector_us.get(name, 0)


@dataclass(frozen=True)
class Burst:
    seconds: float
    cached: list[int]
    steps_us: list[float]
    """Connector time on the scheduler side in each engine step of the burst."""
    asks: list[int]
    """``get_num_new_matched_tokens`` calls in each step."""
    deferred: int
    """Of those calls, the answers ``None`` (not known yet: the request waits a step)."""


class Engine:
    """One engine configuration in its own process, one command at a time over its pipes."""

    def __init__(self, settings: dict[str, Any], log_path: Path) -> None:
        """``settings``: the engine's (see :func:`build_engine`); ``token``, if given, is
        the kvpool connector's token for its agent (as ``KVPOOL_CONNECTOR_TOKEN``, not on
        the command line)."""
        settings = dict(settings)
        token = settings.pop("token", None)
        self.config = str(settings["config"])
        self.log_path = log_path
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            # vLLM's log (and the connector's) into the log file: stdout carries the answers
            "VLLM_LOGGING_STREAM": os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stderr"),
        }
        if token:
            env.pop(CONNECTOR_OLD_NAMES[CONNECTOR_TOKEN_ENV], None)  # not the caller's
            env[CONNECTOR_TOKEN_ENV] = str(token)
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )

    def _answer(self) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(RESULT):
                return line.removeprefix(RESULT).strip()
        tail = "\n".join(self.log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"the {self.config} engine exited:\n{tail}")

    def _ask(self, command: dict[str, Any]) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return json.loads(self._answer())

    def wait_ready(self) -> None:
        assert self._answer() == "ready"

    def generate(self, prompt: list[int], salt: str | None = None) -> Sample:
        """One request; ``salt``: its vLLM ``cache_salt`` (none by default)."""
        command: dict[str, Any] = {"prompt": prompt}
        if salt is not None:
            command["salt"] = salt
        return Sample(**self._ask(command))

    def burst(self, prompts: list[list[int]]) -> Burst:
        return Burst(**self._ask({"burst": prompts}))

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The random model's shape (its head size is :data:`HEAD_SIZE`)."""
    parser.add_argument("--layers", type=problems.number(int), default=8, help="model layers")
    parser.add_argument(
        "--hidden", type=problems.number(int), default=512, help="model hidden size"
    )
    parser.add_argument(
        "--heads", type=problems.number(int), default=8, help="attention heads (head size 64)"
    )
    parser.add_argument("--kv-heads", type=problems.number(int), default=4, help="KV heads")
    parser.add_argument("--intermediate", type=problems.number(int), default=1536, help="MLP size")


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """The model's KV per token: K and V of every layer, bf16."""
    return int(args.layers) * 2 * int(args.kv_heads) * HEAD_SIZE * 2


def write_model(directory: Path, args: argparse.Namespace) -> None:
    """A Llama with random weights (vLLM's dummy weights make attention trivially uniform)."""
    import torch
    from safetensors.torch import save_file

    head = HEAD_SIZE
    hidden, inner, layers = args.hidden, args.intermediate, args.layers
    kv = args.kv_heads * head
    vocab = 8192
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inner,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": head,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": max(8192, 2 * args.prompt_tokens),
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    ones = torch.ones(hidden, dtype=torch.bfloat16)
    tensors = {
        "model.embed_tokens.weight": normal(vocab, hidden, std=1.0),
        "model.norm.weight": ones,
        "lm_head.weight": normal(vocab, hidden, std=0.1),
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": normal(args.heads * head, hidden, std=0.1),
            prefix + "self_attn.k_proj.weight": normal(kv, hidden, std=0.1),
            prefix + "self_attn.v_proj.weight": normal(kv, hidden, std=0.1),
            prefix + "self_attn.o_proj.weight": normal(hidden, args.heads * head, std=0.05),
            prefix + "mlp.gate_proj.weight": normal(inner, hidden, std=0.05),
            prefix + "mlp.up_proj.weight": normal(inner, hidden, std=0.05),
            prefix + "mlp.down_proj.weight": normal(hidden, inner, std=0.05),
            prefix + "input_layernorm.weight": ones,
            prefix + "post_attention_layernorm.weight": ones,
        }
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(
        {name: tensor.clone() for name, tensor in tensors.items()},
        directory / "model.safetensors",
    )


# ------------------------------------------------------------------ child side


@dataclass
class StepTimer:
    """The connector's scheduler-side time per engine step, a step running from one
    ``Scheduler.schedule`` call to the next (so it includes ``update_from_output``'s calls)."""

    steps_us: list[float] = field(default_factory=list)
    asks: list[int] = field(default_factory=list)
    _spent: float = 0.0
    _asked: int = 0
    deferred: int = 0
    _open: bool = False

    def install(self) -> None:
        """Wrap vLLM's scheduler and the connector's scheduler-side methods (class-wide: the
        engine builds its own instances)."""
        from vllm.v1.core.sched.scheduler import Scheduler

        from kvpool.connector.facade import KvpoolConnector

        schedule = Scheduler.schedule

        @functools.wraps(schedule)
        def scheduled(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            self.close()
            self._open = True
            return schedule(scheduler, *args, **kwargs)

        setattr(Scheduler, "schedule", scheduled)  # noqa: B010
        for name in SCHEDULER_CALLS:
            setattr(KvpoolConnector, name, self._timed(getattr(KvpoolConnector, name), name))

    def _timed(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        asks = name == "get_num_new_matched_tokens"

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            answer = method(*args, **kwargs)
            self._spent += time.perf_counter() - started
            if asks:
                self._asked += 1
                self.deferred += answer[0] is None
            return answer

        return timed

    def close(self) -> None:
        """End the current step, if one is open."""
        if self._open:
            self.steps_us.append(self._spent * 1e6)
            self.asks.append(self._asked)
        self._spent, self._asked, self._open = 0.0, 0, False

    def reset(self) -> None:
        self.close()
        self.steps_us.clear()
        self.asks.clear()
        self.deferred = 0


def build_engine(settings: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if settings["config"] in ("kvpool", "tenant", "inline"):
        extra = {"endpoint": settings["endpoint"], "chunk_tokens": settings["chunk_tokens"]}
        if settings["config"] == "inline":  # a pod that mounts nothing: KV in the messages
            extra["segment_path"] = NOT_MOUNTED
        if settings["config"] == "tenant":  # a tenant's pod: the door only, no probe table
            extra["segment_path"] = NOT_MOUNTED
            extra["door_path"] = settings["door"]
        transfer = KVTransferConfig(
            kv_connector="KvpoolConnector",
            kv_connector_module_path="kvpool.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    elif settings["config"] == "example":
        transfer = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": settings["storage"]},
        )
    length = settings["prompt_tokens"] + 64
    return LLM(
        model=settings["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        seed=0,
        max_model_len=length,
        max_num_batched_tokens=max(length, settings.get("batched_tokens", 0)),
        max_num_seqs=settings.get("max_num_seqs", 4),
        # "native": vLLM's own prefix cache serves the repeated prompt, with no transfer at all;
        # the others have it off unless the settings turn it on
        enable_prefix_caching=settings.get("prefix_caching", settings["config"] == "native"),
        distributed_executor_backend="uni",
        disable_log_stats=False,  # the connector's counters come through vLLM's metrics
        kv_transfer_config=transfer,
    )


def _connector_counters(llm: Any) -> dict[str, int]:
    """The kvpool connector's counters so far, per ``vllm:kvpool_<name>`` metric."""
    counts: dict[str, int] = {}
    for metric in llm.get_metrics():
        name = getattr(metric, "name", "").removesuffix("_total")
        if name.startswith(KVPOOL_METRIC):
            counter = name.removeprefix(KVPOOL_METRIC)
            counts[counter] = counts.get(counter, 0) + int(metric.value)
    return counts


def _child(settings: dict[str, Any]) -> None:
    """Serve commands from stdin (one JSON object per line), one answer per line, until EOF."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    timer = StepTimer()
    if settings.get("time_steps"):
        timer.install()
    llm = build_engine(settings)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    print(f"{RESULT}ready", flush=True)
    counts = _connector_counters(llm)
    for line in sys.stdin:
        command = json.loads(line)
        prompts = [
            TokensPrompt(prompt_token_ids=ids)
            for ids in (command["burst"] if "burst" in command else [command["prompt"]])
        ]
        if "salt" in command:
            prompts[0]["cache_salt"] = command["salt"]
        timer.reset()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        timer.close()
        cached = [int(output.num_cached_tokens or 0) for output in outputs]
        before, counts = counts, _connector_counters(llm)
        spent = {name: counts[name] - before.get(name, 0) for name in counts}
        if "burst" in command:
            answer: dict[str, Any] = {
                "seconds": seconds,
                "cached": cached,
                "steps_us": timer.steps_us,
                "asks": timer.asks,
                "deferred": timer.deferred,
            }
        else:
            answer = {
                "seconds": seconds,
                "cached": cached[0],
                "token": outputs[0].outputs[0].token_ids[0],
                "connector_us": {name: n for name, n in spent.items() if name.endswith("_us")},
                "hit_tokens": spent.get("hit_tokens", 0),
            }
        print(RESULT + json.dumps(answer), flush=True)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
