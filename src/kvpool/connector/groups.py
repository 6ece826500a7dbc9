"""Which of vLLM's KV cache groups kvpool caches, and what each keeps of a chunk.

vLLM gives the connector one :class:`~vllm.v1.kv_cache_interface.KVCacheConfig` with
one group per kind of layer (one group for a plain model; several under the hybrid KV
cache manager: full attention, sliding windows, state-space layers). kvpool caches a
group when it knows what a request needs of it to resume at a chunk boundary
(:class:`~kvpool.connector.layout.GroupRule`): full attention and MLA (every
block), sliding windows (the window's blocks), chunked local attention (every block), and
state-space (Mamba) and linear-attention layers (``MambaSpec``: the state at the boundary)
where vLLM caches their states itself ("align" mode: a state per block boundary where a
step ended) and hands each one to the connector (``kv_connector_block_state``).

Anything else (cross-attention, sinks, vLLM's newer sparse kinds, states with speculative
blocks or outside "align" mode) is not cached: :func:`cacheable_groups` says why, naming
the spec and a layer, and the connector serves that engine no hits and stores nothing. A
spec is matched by its exact type, so a new subclass vLLM adds (with rules of its own) is
refused until kvpool knows it, never cached by mistake.

:func:`cannot_resume` reads what vLLM decided for the engine: an MLA model on a platform
whose MLA prefill cannot attend over cached context (vLLM's CPU platform without AMX turns
prefix caching and chunked prefill off for it) must not be handed KV at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvpool.connector.layout import GroupRule

try:  # vLLM 0.32+: DeepSeek V4's windowed MLA
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    _WINDOWS: tuple[type[KVCacheSpec], ...] = (SlidingWindowSpec, SlidingWindowMLASpec)
except ImportError:
    _WINDOWS = (SlidingWindowSpec,)

_FULL: tuple[type[KVCacheSpec], ...] = (FullAttentionSpec, MLAAttentionSpec)


class NotCacheable(Exception):
    """An engine kvpool serves no hits (the message says why, in one line, after
    ``kvpool:``)."""


@dataclass(frozen=True)
class CachedGroup:
    rule: GroupRule
    layer_names: Sequence[str]


def cacheable_groups(config: KVCacheConfig) -> list[CachedGroup]:
    """Every group vLLM transfers, with its rule; :class:`NotCacheable` if one has none."""
    groups = []
    for group in config.kv_cache_groups:
        spec, layer = group.kv_cache_spec, group.layer_names[0] if group.layer_names else "?"
        if not getattr(group, "enable_kv_transfer", True):
            raise NotCacheable(  # a replica vLLM rebuilds from another group after a load
                f"does not cache engines with a group vLLM rebuilds after a load "
                f"({type(spec).__name__}, layer {layer}); this engine gets no hits from "
                "kvpool and stores nothing"
            )
        rule, why = _rule(spec)
        if rule is None:
            raise NotCacheable(
                f"cannot cache {type(spec).__name__}{why} (layer {layer}); this engine gets "
                "no hits from kvpool and stores nothing"
            )
        groups.append(CachedGroup(rule, list(group.layer_names)))
    if not groups:
        raise NotCacheable("vLLM gave kvpool no KV cache group to transfer")
    if all(group.rule.is_state for group in groups):
        raise NotCacheable(
            "does not cache models whose every layer is a state-space or linear-attention "
            "layer (no attention KV to key the states by); this engine gets no hits from "
            "kvpool and stores nothing"
        )
    return groups


def _rule(spec: KVCacheSpec) -> tuple[GroupRule | None, str]:
    """The group's rule, or None and what (beyond the spec's type) kvpool cannot cache."""
    if type(spec) is MambaSpec:
        return _state_rule(spec)
    return _attention_rule(spec), ""


def _state_rule(spec: MambaSpec) -> tuple[GroupRule | None, str]:
    """A state is cached where vLLM caches it: "align" mode, each committed state handed over
    with its block (``SchedulerOutput.kv_connector_block_state``), no speculative blocks."""
    if spec.mamba_cache_mode != "align":
        return None, (
            f" in mamba_cache_mode {spec.mamba_cache_mode!r} (kvpool caches the states vLLM "
            "hands over, in 'align' mode: prefix caching on)"
        )
    if getattr(spec, "num_speculative_blocks", 0):
        return None, f" with {spec.num_speculative_blocks} speculative blocks"
    return GroupRule("state", spec.block_size), ""


def _attention_rule(spec: KVCacheSpec) -> GroupRule | None:
    kind = type(spec)
    if kind in _FULL:
        return GroupRule("full", spec.block_size)
    if kind in _WINDOWS:
        assert isinstance(spec, SlidingWindowSpec)
        retained = getattr(spec, "extra_retained_tokens", 0)
        return GroupRule("window", spec.block_size, spec.sliding_window - 1 + retained)
    if kind is ChunkedLocalAttentionSpec:
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        return GroupRule("local", spec.block_size, spec.attention_chunk_size)
    return None


def cannot_resume(config: VllmConfig) -> str | None:
    """Why this engine cannot use a prefix it did not compute itself, or None.

    vLLM's CPU platform turns prefix caching *and* chunked prefill off where its MLA
    prefill cannot attend over cached context (no AMX): such an engine only ever computes
    a prompt whole, and KV handed to it would be read as garbage. (On a GPU the two being
    off is the user's choice, and its MLA backends attend over cached context.)
    """
    from vllm.platforms import current_platform

    model = config.model_config
    if (
        model is not None
        and current_platform.is_cpu()
        and model.use_mla
        and not config.cache_config.enable_prefix_caching
        and not config.scheduler_config.enable_chunked_prefill
    ):
        return (
            "vLLM turned prefix caching and chunked prefill off for this MLA model (its MLA "
            "prefill on this platform cannot attend over cached context), so kvpool serves it "
            "no hits and stores nothing"
        )
    return None


def loads_per_request(config: KVCacheConfig, groups: Sequence[CachedGroup]) -> bool:
    """Whether a failed load must be reported for its request (vLLM's asynchronous load)
    rather than as failed blocks, which vLLM recomputes from the first one on.

    vLLM takes no failed blocks from an engine of several KV cache groups (a block id is
    unique within its group only: it raises). And resuming at a failed block of a window
    group needs the window before it, whose blocks vLLM never allocated when the hit went
    further (null blocks): recomputing from there would read them. Either way the request
    must be computed anew, from its first token.
    """
    return len(config.kv_cache_groups) > 1 or any(group.rule.kind != "full" for group in groups)


def state_block_size(groups: Sequence[CachedGroup]) -> int | None:
    """The chunk size a model with state-space layers needs, or None for one without.

    vLLM keeps such a layer's state only at the end of a block (by default at the last one
    before the prompt's end), and a hit must end where there is a state: chunks of one block
    (the common block size of every group) make every kept state usable, where chunks of
    ``n`` blocks would miss all but one in ``n``."""
    if not any(group.rule.is_state for group in groups):
        return None
    return math.lcm(*(group.rule.block_size for group in groups))
