"""Greedy ``POST /v1/completions`` to a vLLM OpenAI server (or a gateway in front of one),
read into a :class:`~tests.support.engines.Result` for the comparison up to noise
(:mod:`.greedy`): token-id prompts (the random model has no tokenizer), the generated ids
from ``return_token_ids``, the candidates from ``logprobs``, the hit from
``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from .engine_main import TOP_LOGPROBS
from .engines import Result


@dataclass(frozen=True)
class Completion:
    result: Result
    reply: dict[str, Any]
    headers: httpx.Headers

    @property
    def cached(self) -> int:
        return self.result.cached[0]


def complete(
    url: str,
    model: str,
    tokens: list[int],
    salt: str | None,
    *,
    params: dict[str, Any] | None = None,
    max_tokens: int = 16,
    timeout: float = 120.0,
    log_tail: Callable[[], str] = str,
) -> Completion:
    """The greedy completion of ``tokens`` (``cache_salt`` ``salt``, ``kv_transfer_params``
    ``params``) at ``url``; the test fails with ``log_tail()`` on anything but a 200."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": TOP_LOGPROBS,
        "return_tokens_as_token_ids": True,  # candidates as "token_id:<id>"
    }
    if salt is not None:
        body["cache_salt"] = salt
    if params is not None:
        body["kv_transfer_params"] = params
    started = time.perf_counter()
    try:
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
    except httpx.HTTPError as error:
        pytest.fail(f"no answer ({error!r}); log:\n{log_tail()}")
    seconds = time.perf_counter() - started
    if answer.status_code != 200:
        pytest.fail(f"{answer.status_code} {answer.text}; log:\n{log_tail()}")
    reply = answer.json()
    choice = reply["choices"][0]
    top = [
        sorted(
            ((int(name.removeprefix("token_id:")), logprob) for name, logprob in position.items()),
            key=lambda candidate: -candidate[1],
        )
        for position in choice["logprobs"]["top_logprobs"]
    ]
    result = Result(
        tokens=[choice["token_ids"]],
        cached=[reply["usage"]["prompt_tokens_details"]["cached_tokens"]],
        seconds=seconds,
        counters={},
        top=[top],
    )
    return Completion(result, reply, answer.headers)
