"""What the endpoint picker is asked, and what it answers: the types between its edge and its core.

The edge (:mod:`kvpool.index.epp`, Envoy's external-processing gRPC service) turns one
inference request into a :class:`PickRequest`; the core (:mod:`kvpool.index.picker`) turns
that into a :class:`Pick`, or raises :class:`NoEndpoint` (the gateway answers 503). Nothing
here knows gRPC, HTTP or the index's trackers.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


@dataclass(frozen=True)
class PickRequest:
    token_ids: Sequence[int]
    """The prompt as the engine will see it (a chat's messages after its template)."""
    cache_salt: str | None
    """The request's ``cache_salt``: a tenant's salt or a shared space's structured salt."""
    model: str | None = None
    """The body's ``model``, as the client named it."""
    subset: frozenset[str] | None = None
    """The proxy's endpoint-subset hint (``ip:port`` each): only these may be picked; ``None``
    when the proxy sent no hint."""


class PickReason(enum.StrEnum):
    PREFIX = "prefix"
    """The endpoint that can load the most of the prompt soonest, within the load bound."""
    LOAD = "load"
    """No endpoint holds enough of the prompt to matter: the least loaded."""
    FAIL_OPEN = "fail_open"
    """The index did not answer within the deadline: the least loaded, by load alone."""
    PD = "pd"
    """Disaggregated: another pod prefills the prompt; the endpoint, the least loaded
    decode-capable server, decodes."""


class Disaggregation(enum.StrEnum):
    """Whether a pick disaggregated prefill from decode, or why not."""

    DISAGGREGATED = "disaggregated"
    DISABLED = "disabled"
    """``picker.pd.enabled`` is off."""
    SHORT = "short"
    """The part of the prompt the decode pod cannot load is below the threshold."""
    NO_DECODE_READY = "no_decode_ready"
    """No decode-capable server is ready: a prefill server takes the request whole."""
    NO_PREFILL_READY = "no_prefill_ready"
    """No ready prefill-capable server other than the decode pod."""
    PREFILL_BUSY = "prefill_busy"
    """Every such server has more requests waiting than ``max_prefill_waiting``."""


class PrefillPod(NamedTuple):
    """The server that prefills a disaggregated request's prompt."""

    address: str
    """``ip:port`` of its OpenAI server."""
    node: str
    """The node it runs on (where the decode pod's agent finds the prompt's chunks)."""


class Pick(NamedTuple):  # a tuple: one per request, on the picker's path
    endpoint: str
    """``ip:port`` of the chosen model server (the decode pod, when disaggregated)."""
    reason: PickReason
    cached_tokens: int = 0
    """Tokens of the prompt the chosen endpoint (the prefill pod, when disaggregated) can
    load rather than compute."""
    prefill: PrefillPod | None = None
    """The prefill pod, when the pick disaggregated (reason ``pd``)."""


class NoEndpoint(Exception):
    """No endpoint may take the request (none known, none ready, or none in the subset)."""


class Picker(Protocol):
    def pick(self, request: PickRequest) -> Pick:
        """Choose the endpoint for one request; :class:`NoEndpoint` when none can take it.
        Called from many threads at once; returns within the picker's deadline."""
        ...
