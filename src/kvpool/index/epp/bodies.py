"""What to pick for, read from an OpenAI request: the prompt's token ids, the cache salt,
the model.

The ids must be those the engine will compute, or the picker scores a prefix the engine
never caches: ``/v1/completions`` prompts are token ids as given, or text tokenized with
the model's special tokens (``add_special_tokens``, default true); ``/v1/chat/completions``
messages go through the chat template and are tokenized without them (default false).
Text the picker cannot tokenize (no tokenizer configured, a template that refuses the
conversation, images) is routed by load alone (no ids): the engine, not the picker, says
what is wrong with a request it can still read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.index.prompts import Prompts

log = logging.getLogger(__name__)
_rare = RateLimitedLog(log)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


class Refused(Exception):
    """A request the edge answers itself: ``status`` with a one-line ``message``;
    ``reason`` is the counters' label."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Wanted:
    """What a body asks the picker for."""

    token_ids: Sequence[int] = ()
    cache_salt: str | None = None
    model: str | None = None


def _bad(message: str) -> Refused:
    return Refused(400, "bad_request", message)


def read_body(path: str, body: bytes, prompts: Prompts | None, max_prompt_tokens: int) -> Wanted:
    """What the POST ``body`` to ``path`` asks for; :class:`Refused` (400, 413) for a body
    the engine would refuse as well. Paths other than the two generation routes are
    picked by load alone and their bodies are not read."""
    route = path.split("?", 1)[0]
    if route not in (COMPLETIONS, CHAT):
        return Wanted()
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise _bad(f"the body is not JSON: {str(error)[:120]}") from None
    if not isinstance(parsed, dict):
        raise _bad("the body is not a JSON object")
    cache_salt = _optional_string(parsed, "cache_salt")
    model = _optional_string(parsed, "model")
    ids = _completion_ids(parsed, prompts) if route == COMPLETIONS else _chat_ids(parsed, prompts)
    if len(ids) > max_prompt_tokens:
        raise Refused(
            413,
            "prompt_too_large",
            f"the prompt has {len(ids)} tokens, more than the picker's {max_prompt_tokens}",
        )
    return Wanted(tuple(ids), cache_salt, model)


def _optional_string(body: dict[str, Any], field: str) -> str | None:
    value = body.get(field)
    if value is not None and not isinstance(value, str):
        raise _bad(f"{field} must be a string, not {type(value).__name__}")
    return value


def _flag(body: dict[str, Any], field: str, default: bool) -> bool:
    value = body.get(field, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{field} must be true or false, not {type(value).__name__}")
    return value


MAX_TOKEN_ID = (1 << 32) - 1
"""Larger than any vocabulary; bounds what the picker's core hashes."""


def _token_ids(values: list[Any], field: str) -> list[int]:
    for value in values:
        if type(value) is not int or not 0 <= value <= MAX_TOKEN_ID:
            raise _bad(
                f"{field} must hold token ids (integers from 0 to {MAX_TOKEN_ID}), "
                f"not {str(value)[:40]!r}"
            )
    return values


def _completion_ids(body: dict[str, Any], prompts: Prompts | None) -> list[int]:
    """A batch of prompts is picked for its first: they go to one endpoint together, and
    the first one's prefix is the one a client repeating a batch shares."""
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt is missing")
    prompt = body["prompt"]
    add_special_tokens = _flag(body, "add_special_tokens", True)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if not all(isinstance(each, str) for each in prompt) and not all(
            isinstance(each, list) and each for each in prompt
        ):
            raise _bad("prompt must be a batch of strings or of token id lists, not both")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _tokenized(prompts, lambda p: p.encode(prompt, add_special_tokens))
    if isinstance(prompt, list) and prompt:
        return _token_ids(prompt, "prompt")
    raise _bad("prompt must be a string, token ids, or a non-empty list of either")


def _chat_ids(body: dict[str, Any], prompts: Prompts | None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{index}] must be an object with a string role")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final_message = _flag(body, "continue_final_message", False)
    add_special_tokens = _flag(body, "add_special_tokens", False)
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise _bad("chat_template_kwargs must be an object")
    extra = {**extra, **_request_variables(body, extra)}
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools must be a list")
    return _tokenized(
        prompts,
        lambda p: p.chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            add_special_tokens=add_special_tokens,
            tools=tools,
            template_kwargs=extra,
        ),
    )


def _request_variables(body: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The request fields vLLM hands the template over ``chat_template_kwargs`` (those
    that are set: vLLM drops a ``None``)."""
    variables = {
        name: body[name] for name in ("documents", "reasoning_effort") if body.get(name) is not None
    }
    if "reasoning_effort" in variables and "enable_thinking" not in extra:
        variables["enable_thinking"] = variables["reasoning_effort"] != "none"
    return variables


def _tokenized(prompts: Prompts | None, tokenize: Callable[[Prompts], list[int]]) -> list[int]:
    """The ids ``tokenize(prompts)`` gives; none (route by load) without a tokenizer or
    when it fails: the engine answers the client for a prompt it cannot render."""
    if prompts is None:
        return []
    try:
        ids = tokenize(prompts)
    except Exception as error:  # a template's raise_exception, images, odd content
        _rare.info(f"a prompt routed by load: not tokenized: {type(error).__name__}")
        return []
    return ids
