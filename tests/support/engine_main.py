"""One vLLM engine in its own process, driven over stdin/stdout by :mod:`.engines`.

Started as ``python engine_main.py '<json settings>'``. It builds an in-process
engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor, so the
scheduler and the worker share this process and start fast), prints
``@@ready``, then answers one JSON request per line with one ``@@result <json>``
line. Everything else on stdout is vLLM's and is ignored by the driver.

``patches`` in the settings (``"module:function"``, each called before the engine is built)
work around a vLLM limit in this process only, e.g. :mod:`.cpu_mamba2`.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any

MARK = "@@"
TOP_LOGPROBS = 5
"""Candidates reported per generated token, for comparisons within a tolerance."""


def build(settings: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if settings.get("connector") == "kvpool":
        transfer = KVTransferConfig(
            kv_connector="KvpoolConnector",
            kv_connector_module_path="kvpool.connector",
            kv_role="kv_both",
            kv_connector_extra_config=settings["extra_config"],
        )
    elif settings.get("connector") == "example":
        transfer = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": settings["storage_path"]},
        )
    extra: dict[str, Any] = {}
    if settings.get("num_blocks"):
        extra["num_gpu_blocks_override"] = settings["num_blocks"]
    if settings.get("kv_events"):  # vLLM's KVEventsConfig fields (its ZMQ KV-event publisher)
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(**settings["kv_events"])
    if settings.get("block_size"):
        extra["block_size"] = settings["block_size"]
    return LLM(
        model=settings["model"],
        # float32 unless a test asks for another: vLLM's CPU engine runs the models' bf16 at
        # speed only with AVX-512 bf16 or AMX (a prefill 30 times slower on AVX2 alone, where
        # float32 is 4 times faster than bf16); no test depends on bf16 arithmetic
        dtype=settings.get("dtype", "float32"),
        load_format=settings.get("load_format", "safetensors"),
        skip_tokenizer_init=True,
        enforce_eager=True,
        seed=0,
        max_model_len=settings.get("max_model_len", 4096),
        max_num_batched_tokens=settings.get("max_num_batched_tokens", 4096),
        max_num_seqs=settings.get("max_num_seqs", 8),
        enable_prefix_caching=settings.get("prefix_caching", True),
        distributed_executor_backend="uni",
        disable_log_stats=False,
        kv_transfer_config=transfer,
        **extra,
    )


def kvpool_counters(llm: Any) -> dict[str, float]:
    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = getattr(metric, "name", "")
        if name.startswith("vllm:kvpool_"):
            counters[name.removeprefix("vllm:kvpool_").removesuffix("_total")] = metric.value
    return counters


def top_logprobs(positions: Any) -> list[list[tuple[int, float]]]:
    """Each generated position's top candidates as (token, log-probability), best first."""
    return [
        sorted(((token, entry.logprob) for token, entry in position.items()), key=lambda t: -t[1])
        for position in positions or []
    ]


def generate(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    salts = request.get("salts") or [None] * len(request["prompts"])
    prompts = []
    for ids, salt in zip(request["prompts"], salts, strict=True):
        prompt = TokensPrompt(prompt_token_ids=ids)
        if salt is not None:  # "$NAME": the pod's variable NAME, as a team's gateway stamps it
            prompt["cache_salt"] = os.environ[salt[1:]] if salt.startswith("$") else salt
        prompts.append(prompt)
    params = SamplingParams(
        max_tokens=request.get("max_tokens", 8),
        temperature=0.0,
        ignore_eos=True,
        logprobs=TOP_LOGPROBS,
    )
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return {
        "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        "top": [top_logprobs(output.outputs[0].logprobs) for output in outputs],
        "cached": [output.num_cached_tokens for output in outputs],
        "seconds": seconds,
        "counters": kvpool_counters(llm),
    }


def patch(settings: dict[str, Any]) -> None:
    """Call each of the settings' ``patches`` (``"module:function"``)."""
    for name in settings.get("patches", []):
        module, _, function = name.partition(":")
        getattr(importlib.import_module(module), function)()


def main() -> None:
    settings = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    patch(settings)
    llm = build(settings)
    print(f"{MARK}ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "stop":
            break
        print(f"{MARK}result {json.dumps(generate(llm, request))}", flush=True)


if __name__ == "__main__":
    main()
