"""What the sidecar's flags decide, in one object the proxy reads."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common.names import DEFAULT_PD_DECODE_WAIT_MS, DEFAULT_PD_PREFILL_TIMEOUT_SECONDS


@dataclass(frozen=True)
class SidecarSettings:
    vllm: str
    """The local vLLM OpenAI server's base URL (``http://127.0.0.1:8200``)."""
    key: bytes | None
    """The pool's disaggregation key; None: no signed prefill header is followed."""
    node: str | None
    """This pod's node, which the prefill's agent pushes the prompt's chunks to."""
    prefill_timeout_s: float = DEFAULT_PD_PREFILL_TIMEOUT_SECONDS
    """How long a prefill may take before the local vLLM computes the prompt instead."""
    decode_wait_ms: int = DEFAULT_PD_DECODE_WAIT_MS
    """How long the decode may wait for the prefill's chunks (the connector caps it)."""
    llmd_header_compat: bool = False
    """Follow llm-d's unsigned ``x-prefiller-host-port`` too (see the docs: unsafe without
    a NetworkPolicy that lets only the gateway reach this port)."""
