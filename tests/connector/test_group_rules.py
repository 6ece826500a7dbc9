"""Which of vLLM's KV cache groups kvpool caches, and what it keeps of each (with vLLM's
real spec types; :mod:`kvpool.connector.groups`)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from .vllm_steps import cpu_platform_env

os.environ.update(cpu_platform_env())  # before vLLM's first import picks its platform

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvpool.connector.groups import (
    NotCacheable,
    cacheable_groups,
    cannot_resume,
    loads_per_request,
    state_block_size,
)
from kvpool.connector.layout import GroupRule, LayoutError

BLOCK = 16
HEADS: dict[str, Any] = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}


def config(*specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_every_attention_kind_has_its_rule() -> None:
    groups = cacheable_groups(
        config(
            FullAttentionSpec(block_size=BLOCK, **HEADS),
            SlidingWindowSpec(block_size=BLOCK, sliding_window=128, **HEADS),
            MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
            ChunkedLocalAttentionSpec(block_size=BLOCK, attention_chunk_size=8192, **HEADS),
        )
    )
    assert [group.rule for group in groups] == [
        GroupRule("full", BLOCK),
        GroupRule("window", BLOCK, 127),
        GroupRule("full", BLOCK),
        GroupRule("local", BLOCK, 8192),
    ]
    assert [group.layer_names for group in groups] == [[f"model.layers.{i}.attn"] for i in range(4)]


def test_a_window_keeps_the_blocks_a_resumed_token_looks_back_on() -> None:
    window = GroupRule("window", BLOCK, 127)  # a 128-token window looks back 127 tokens
    assert window.kept_blocks(256) == 8  # of 16
    assert window.kept_blocks(64) == 4  # all of them: the window is longer than the chunk
    assert GroupRule("window", BLOCK, 128).kept_blocks(256) == 8
    assert GroupRule("window", BLOCK, 129).kept_blocks(256) == 9
    assert (
        GroupRule("full", BLOCK).kept_blocks(256)
        == GroupRule("local", BLOCK, 512).kept_blocks(256)
        == 16
    )


def mamba(**fields: Any) -> MambaSpec:
    return MambaSpec(block_size=BLOCK, shapes=((3, 256),), dtypes=(torch.bfloat16,), **fields)


def test_a_state_group_vllm_caches_keeps_one_block_per_state_record() -> None:
    """In vLLM's "align" mode a state-space (or linear-attention) layer's state is cached
    where a step ended on a block boundary; kvpool keeps that block, beside the chunk."""
    full = FullAttentionSpec(block_size=BLOCK, **HEADS)
    groups = cacheable_groups(config(full, mamba(mamba_cache_mode="align")))
    assert [group.rule for group in groups] == [GroupRule("full", BLOCK), GroupRule("state", BLOCK)]
    state = groups[1].rule
    assert state.is_state and state.name == "state"
    assert (state.blocks_per_chunk(256), state.kept_blocks(256)) == (1, 1)
    with pytest.raises(LayoutError, match="not a multiple of vLLM's block size 16"):
        state.blocks_per_chunk(40)  # a state exists only at a block's end
    assert loads_per_request(config(full, mamba(mamba_cache_mode="align")), groups)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({}, r"MambaSpec in mamba_cache_mode 'none' \(kvpool caches the states .* 'align' mode"),
        (
            {"mamba_cache_mode": "align", "num_speculative_blocks": 2},
            "MambaSpec with 2 speculative blocks",
        ),
    ],
)
def test_a_state_group_vllm_caches_no_states_for_is_refused_naming_a_layer(
    fields: dict[str, Any], why: str
) -> None:
    with pytest.raises(NotCacheable, match=why + r".* \(layer model.layers.1.attn\)"):
        cacheable_groups(config(FullAttentionSpec(block_size=BLOCK, **HEADS), mamba(**fields)))


def test_a_model_with_states_takes_chunks_of_one_block() -> None:
    """vLLM keeps a state only at a block's end: chunks of one block make each usable."""
    full = FullAttentionSpec(block_size=BLOCK, **HEADS)
    assert state_block_size(cacheable_groups(config(full))) is None
    groups = cacheable_groups(config(full, mamba(mamba_cache_mode="align")))
    assert state_block_size(groups) == BLOCK


def test_a_model_of_states_only_is_refused() -> None:
    """A state record hangs off the chunk that ends where it was taken; a model with no
    attention has no chunk to key its states by."""
    with pytest.raises(NotCacheable, match="every layer is a state-space"):
        cacheable_groups(config(mamba(mamba_cache_mode="align")))


def test_an_unknown_subclass_is_refused_not_cached_by_its_base() -> None:
    class NewAttentionSpec(FullAttentionSpec):  # a kind vLLM adds, with rules of its own
        pass

    with pytest.raises(NotCacheable, match="NewAttentionSpec"):
        cacheable_groups(config(NewAttentionSpec(block_size=BLOCK, **HEADS)))


def test_mla_that_cannot_use_cached_context_is_not_served() -> None:
    def engine(mla: bool, prefix_caching: bool, chunked_prefill: bool) -> Any:
        return SimpleNamespace(
            model_config=SimpleNamespace(use_mla=mla),
            cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
            scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill),
        )

    assert "MLA" in (cannot_resume(engine(True, False, False)) or "")
    assert cannot_resume(engine(True, True, True)) is None  # MLA on a GPU
    assert cannot_resume(engine(True, False, True)) is None  # prefix caching off by choice
    assert cannot_resume(engine(False, False, False)) is None  # not MLA


def test_a_window_or_several_groups_fail_loads_per_request() -> None:
    full = FullAttentionSpec(block_size=BLOCK, **HEADS)
    window = SlidingWindowSpec(block_size=BLOCK, sliding_window=128, **HEADS)
    for specs, per_request in (((full,), False), ((window,), True), ((full, window), True)):
        plan = config(*specs)
        assert loads_per_request(plan, cacheable_groups(plan)) is per_request, specs


def test_local_attention_chunks_must_hold_whole_kvpool_chunks() -> None:
    """vLLM frees a local-attention chunk's blocks at its edge, maybe before a kvpool chunk
    across that edge is full and stored: such a chunk size is refused, not cached wrong."""
    assert GroupRule("local", BLOCK, 8192).kept_blocks(256) == 16
    with pytest.raises(LayoutError, match="does not divide the model's 8192-token"):
        GroupRule("local", BLOCK, 8192).kept_blocks(3072)


def test_a_group_vllm_rebuilds_after_a_load_is_refused() -> None:
    plan = config(FullAttentionSpec(block_size=BLOCK, **HEADS))
    plan.kv_cache_groups[0].enable_kv_transfer = False
    with pytest.raises(NotCacheable, match="rebuilds after a load"):
        cacheable_groups(plan)
