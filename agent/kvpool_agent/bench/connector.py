"""``kvpool bench connector``: time to first token with our vLLM connector, without one, and
with vLLM's ExampleConnector.

One run, one engine configuration per child process (same model, same engine
settings): ``none`` (no connector: every prefill is computed), ``kvpool`` (our
connector and a private ``kvpool-agent``, or ``--endpoint``) and ``example``
(vLLM's built-in ExampleConnector, its disk-based reference, in a temporary
directory). vLLM's own prefix cache is off in all three, so a repeated prompt
is served from the external cache, as it would be in another engine or after
vLLM evicted it.

The model is a Llama with random weights (``--layers``, ``--hidden`` ...), big
enough that prefill dominates. Each engine is warmed up, then:

* **repeated prefix**: one ``--prompt-tokens`` prompt sent ``--requests`` + 1
  times, one at a time, ``max_tokens=1``; the first run stores, the others are
  timed (TTFT = the wall time of the request);
* **0% hit rate**: ``--requests`` distinct prompts of the same length: every
  lookup misses and every chunk is stored, the connector's pure overhead.

The engines run side by side but serve one request at a time, round-robin
(each round sends the same prompt to every engine back to back, starting with a
different engine each round), so a busy machine slows all of them alike. The
table gives the median TTFT, the prefill throughput (prompt tokens / TTFT), the
tokens each request found cached, and the median of the per-round ratios to
``none``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool_agent.bench.report import table
from kvpool_agent.testing.agent_process import running_agent

CONFIGS = ("none", "kvpool", "example")
RESULT = "@@kvpool-bench "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="tokens per prompt")
    parser.add_argument("--requests", type=int, default=8, help="timed rounds per scenario")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=128,
        help="kvpool chunk size (default: one CPU block, the ExampleConnector's granularity)",
    )
    parser.add_argument("--layers", type=int, default=8, help="model layers")
    parser.add_argument("--hidden", type=int, default=512, help="model hidden size")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (head size 64)")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads")
    parser.add_argument("--intermediate", type=int, default=1536, help="MLP size")
    parser.add_argument("--endpoint", help="use this running agent instead of a private one")


def run(args: argparse.Namespace) -> None:
    configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-bench-connector-") as work,
        contextlib.ExitStack() as agent,
    ):
        workdir = Path(work)
        model = workdir / "model"
        _write_model(model, args)
        endpoint = args.endpoint
        if "kvpool" in configs and endpoint is None:
            endpoint = agent.enter_context(running_agent({"POOL": "bench", "L1_SIZE": "2GiB"})).zmq
        engines: list[_Engine] = []
        try:
            for config in configs:
                settings = {
                    "config": config,
                    "model": str(model),
                    "prompt_tokens": args.prompt_tokens,
                    "chunk_tokens": args.chunk_tokens,
                    "endpoint": endpoint,
                    "storage": str(workdir / "example"),
                }
                engines.append(_Engine(settings, workdir / f"{config}.log"))
            for engine in engines:
                engine.wait_ready()
            results = _measure(engines, args.prompt_tokens, args.requests)
        finally:
            for engine in engines:
                engine.stop()
    print(report(results, args))


# ------------------------------------------------------------------ parent side


@dataclass(frozen=True)
class Sample:
    seconds: float
    cached: int
    token: int
    connector_us: int
    """Time the kvpool connector itself spent on the request (its own counters)."""


@dataclass
class ConfigResult:
    config: str
    repeated: list[Sample]
    misses: list[Sample]


def _measure(engines: list[_Engine], length: int, requests: int) -> list[ConfigResult]:
    """Round-robin, one request at a time: every round sees each engine under the same load."""
    rng = random.Random(1)

    def prompt() -> list[int]:
        return [rng.randrange(3, 8000) for _ in range(length)]

    for _ in range(2):  # warm-up: allocator, kernels, the agent connection
        warm = prompt()
        for engine in engines:
            engine.generate(warm)
    shared = prompt()
    for engine in engines:
        engine.generate(shared)  # computed and stored (with a connector)
    results = [ConfigResult(engine.config, [], []) for engine in engines]
    for round_ in range(requests):
        order = [(round_ + offset) % len(engines) for offset in range(len(engines))]
        for index in order:
            results[index].repeated.append(engines[index].generate(shared))
        fresh = prompt()
        for index in order:
            results[index].misses.append(engines[index].generate(fresh))
    return results


def report(results: list[ConfigResult], args: argparse.Namespace) -> str:
    tokens = args.prompt_tokens
    baseline = next((result for result in results if result.config == "none"), None)
    rows: list[list[object]] = []
    for scenario in ("repeated prefix", "0% hit rate"):
        for result in results:
            samples = result.repeated if scenario == "repeated prefix" else result.misses
            seconds = [sample.seconds for sample in samples]
            ttft = statistics.median(seconds)
            versus = ""
            if baseline is not None and result is not baseline:
                base = baseline.repeated if scenario == "repeated prefix" else baseline.misses
                # paired: each round ran every config back to back
                ratio = statistics.median(
                    sample.seconds / reference.seconds
                    for sample, reference in zip(samples, base, strict=True)
                )
                versus = f"{1 / ratio:.2f}x faster" if ratio < 1 else f"{ratio - 1:+.1%} slower"
            own = statistics.median(sample.connector_us for sample in samples) / 1000
            rows.append(
                [
                    scenario,
                    result.config,
                    f"{ttft * 1000:.0f}",
                    f"{min(seconds) * 1000:.0f}-{max(seconds) * 1000:.0f}",
                    f"{tokens / ttft:,.0f}",
                    f"{statistics.median(sample.cached for sample in samples):.0f}",
                    f"{own:.1f}" if result.config == "kvpool" else "",
                    versus,
                ]
            )
    title = (
        f"vLLM connectors: {args.layers}-layer Llama (hidden {args.hidden}), "
        f"{tokens}-token prompts, {args.chunk_tokens}-token kvpool chunks, "
        f"{args.requests} rounds, vLLM prefix cache off"
    )
    header = [
        "scenario",
        "config",
        "TTFT p50 ms",
        "min-max ms",
        "prefill tok/s",
        "cached tok",
        "connector ms",
        "vs none (paired p50)",
    ]
    first_tokens = {
        tuple(sample.token for sample in result.repeated + result.misses) for result in results
    }
    lines = [table(title, header, rows)]
    ours = next((result for result in results if result.config == "kvpool"), None)
    if ours is not None and baseline is not None:
        own_s = statistics.median(sample.connector_us for sample in ours.misses) / 1e6
        recompute_s = statistics.median(sample.seconds for sample in baseline.misses)
        lines.append(
            f"kvpool at 0% hits: {own_s * 1000:.1f} ms of its own work per request "
            f"(lookup, planning, copies, agent round trips) = {own_s / recompute_s:.2%} "
            "of a recompute"
        )
    lines.append(
        "first tokens identical across configs: " + ("yes" if len(first_tokens) == 1 else "NO")
    )
    load = os.getloadavg()[0]
    lines.append(f"load average during the run: {load:.1f} on {os.cpu_count()} CPUs")
    return "\n".join(lines)


class _Engine:
    """One engine configuration in its own process, one request at a time over its pipes."""

    def __init__(self, settings: dict[str, Any], log_path: Path) -> None:
        self.config = str(settings["config"])
        self.log_path = log_path
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
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

    def wait_ready(self) -> None:
        assert self._answer() == "ready"

    def generate(self, prompt: list[int]) -> Sample:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(prompt) + "\n")
        self.process.stdin.flush()
        return Sample(**json.loads(self._answer()))

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


def _write_model(directory: Path, args: argparse.Namespace) -> None:
    """A Llama with random weights (vLLM's dummy weights make attention trivially uniform)."""
    import torch
    from safetensors.torch import save_file

    head = 64
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


def _engine(settings: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if settings["config"] == "kvpool":
        transfer = KVTransferConfig(
            kv_connector="KvpoolConnector",
            kv_connector_module_path="kvpool_agent.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "endpoint": settings["endpoint"],
                "chunk_tokens": settings["chunk_tokens"],
            },
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
        max_num_batched_tokens=length,
        max_num_seqs=4,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        disable_log_stats=False,  # the connector's counters come through vLLM's metrics
        kv_transfer_config=transfer,
    )


def _connector_us(llm: Any) -> int:
    """The kvpool connector's own time so far (scheduler, loads, stores), from vLLM's metrics."""
    names = {f"vllm:kvpool_{name}_us" for name in ("scheduler", "load", "store")}
    return sum(
        int(metric.value)
        for metric in llm.get_metrics()
        if getattr(metric, "name", "").removesuffix("_total") in names
    )


def _child(settings: dict[str, Any]) -> None:
    """Serve prompts from stdin (one JSON list per line), one answer per line, until EOF."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(settings)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    print(f"{RESULT}ready", flush=True)
    spent = _connector_us(llm)
    for line in sys.stdin:
        ids = json.loads(line)
        started = time.perf_counter()
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        before, spent = spent, _connector_us(llm)
        sample = {
            "seconds": seconds,
            "cached": int(output.num_cached_tokens or 0),
            "token": output.outputs[0].token_ids[0],
            "connector_us": spent - before,
        }
        print(RESULT + json.dumps(sample), flush=True)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
