"""The command line of vLLM's OpenAI server as the engine tests run it: the random model,
token-id prompts (no tokenizer), eager float32 on the CPU, a fixed seed, and each reply's
``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

import json
import sys
from typing import Any


def openai_server_command(
    model: str,
    *,
    served_model_name: str,
    host: str,
    port: int,
    max_model_len: int,
    transfer: dict[str, Any] | None,
    more: tuple[str, ...] = (),
    python: str = sys.executable,
) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` on ``host:port`` with the connector
    configured by ``transfer`` (``--kv-transfer-config``; None: no connector), then ``more``
    arguments; ``python``: the interpreter of the venv vLLM is installed in."""
    connector = [] if transfer is None else ["--kv-transfer-config", json.dumps(transfer)]
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--skip-tokenizer-init",  # token-id prompts; the random model has no tokenizer
        "--enforce-eager",
        "--dtype",  # as tests.support.engine_main: fast on any x86 CPU, bf16 only with AVX-512
        "float32",
        "--seed",
        "0",
        "--max-model-len",
        str(max_model_len),
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
        *connector,
        *more,
    ]
