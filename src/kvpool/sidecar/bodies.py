"""The JSON bodies of a disaggregated request: what the prefill pod is sent, what its answer
must hold, and what the local vLLM is sent to decode. No I/O: the proxy and the prefill's
request use these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from kvpool.common.disagg import DecodeParams, ParamsError, PrefillParams, read_params

PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
"""Fields the prefill's body goes without: it answers one token, in one JSON response."""


@dataclass(frozen=True)
class Prefilled:
    """What the prefill pod's answer gives the decode."""

    params: DecodeParams
    prompt_token_ids: list[int] | None
    """The prompt as the prefill tokenized it (chat only: see :func:`read_prefilled`)."""


def prefill_body(request: Mapping[str, object], push_to: str | None) -> dict[str, object]:
    """The prefill pod's body: the client's request cut to one token, not streamed, with the
    prompt's token ids in the answer and kvpool's prefill params (push to ``push_to``).
    ``model`` and ``cache_salt`` stay: the prefill keys the chunks as the decode will."""
    body = {name: value for name, value in request.items() if name not in PREFILL_DROPPED}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["return_token_ids"] = True
    body["kv_transfer_params"] = PrefillParams(push_to=push_to).to_json()
    return body


def read_prefilled(response: object, *, chat: bool) -> Prefilled | None:
    """What the prefill pod's JSON answer gives the decode; None when it gives nothing usable
    (no kvpool decode params: a prefill pod without kvpool's connector, or malformed ones).

    The prompt's token ids are taken for chat only: vLLM's chat renderer reuses
    ``kv_transfer_params["prompt_token_ids"]`` instead of rendering the template again (so
    the decode's prompt is the prefill's, token for token), while its completions endpoint
    ignores them and would only carry the list into the engine's sampling metadata.
    """
    if not isinstance(response, Mapping):
        return None
    try:
        params = read_params(response.get("kv_transfer_params"))
    except ParamsError:
        return None
    if not isinstance(params, DecodeParams):
        return None
    return Prefilled(params, _prompt_token_ids(response) if chat else None)


def _prompt_token_ids(response: Mapping[str, object]) -> list[int] | None:
    """A chat response's top-level ``prompt_token_ids`` (vLLM's ChatCompletionResponse,
    with ``return_token_ids``), if it is a list of token ids."""
    ids = response.get("prompt_token_ids")
    if not isinstance(ids, list) or not ids:
        return None
    if not all(type(token) is int and token >= 0 for token in ids):
        return None
    return ids


def decode_body(
    request: Mapping[str, object], prefilled: Prefilled, *, node: str, wait_ms: int
) -> dict[str, object]:
    """The local vLLM's body: the client's request, with kvpool's decode params naming the
    prefill's ``node`` and how long to wait for its chunks (and the prompt's token ids)."""
    params = replace(prefilled.params, node=node or None, wait_ms=wait_ms).to_json()
    if prefilled.prompt_token_ids is not None:
        params["prompt_token_ids"] = prefilled.prompt_token_ids
    return {**request, "kv_transfer_params": params}
