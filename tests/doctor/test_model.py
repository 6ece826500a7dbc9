"""The model check: each kind of layer of a model's config.json, and what kvpool does with it.

The configs are the fields that matter of the models' own config.json files on the Hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.tools.doctor.model import check_model
from kvpool.tools.doctor.report import Outcome
from tests.doctor.conftest import run_doctor

pytestmark = pytest.mark.process

CACHED = "every layer cached"
LOCAL_8192 = "chunked local attention 8192 (cached if chunk_tokens divides it)"
MLA_ON_CPU = (
    "cached on GPUs; on a CPU without AMX vLLM runs MLA without prefix caching and kvpool "
    "serves no hits"
)
NO_HITS = "this engine gets no hits from kvpool (it still serves)"
KEPT = "(kept: the window's blocks of each chunk)"
STATE = "state-space (mamba) (kept: the state at a chunk's end)"
AT_STATES = (
    "a hit ends where vLLM's prefix caching kept the state-space layers' state (by default "
    "the last block boundary before a prompt's end; none with speculative decoding)"
)

GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
}
GEMMA_3_4B = {  # multimodal: the language model's config is text_config, its pattern left out
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "num_hidden_layers": 34,
        "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 27},
}
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 24,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "num_local_experts": 32,
}
MISTRAL_7B_V01 = {
    "model_type": "mistral",
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
}
QWEN2_7B = {
    "model_type": "qwen2",
    "num_hidden_layers": 28,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
}
LLAMA_4_TEXT = {
    "model_type": "llama4_text",
    "num_hidden_layers": 48,
    "attention_chunk_size": 8192,
    "no_rope_layers": [],
    "interleave_moe_layer_step": 1,
}
LLAMA_4_SCOUT = {"model_type": "llama4", "text_config": LLAMA_4_TEXT}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "num_nextn_predict_layers": 1,
}
JAMBA = {
    "model_type": "jamba",
    "num_hidden_layers": 32,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "expert_layer_period": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
}
NEMOTRON_H_PATTERN = "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H = {
    "model_type": "nemotron_h",
    "num_hidden_layers": len(NEMOTRON_H_PATTERN),
    "hybrid_override_pattern": NEMOTRON_H_PATTERN,
    "mamba_num_heads": 128,
    "ssm_state_size": 128,
}
MAMBA2 = {"model_type": "mamba2", "num_hidden_layers": 64, "state_size": 128}
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12,
    "linear_num_key_heads": 16,
    "linear_conv_kernel_dim": 4,
}
LLAMA_3_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
}


@pytest.mark.parametrize(
    ("config", "seen"),
    [
        (
            GEMMA_3_1B,
            f"gemma3_text, 26 layers: 22 sliding window 512 {KEPT}, 4 full attention: {CACHED}",
        ),
        (
            GEMMA_3_4B,
            f"gemma3, 34 layers: 29 sliding window 1024 {KEPT}, 5 full attention: {CACHED}",
        ),
        (
            GPT_OSS_20B,
            f"gpt_oss, 24 layers: 12 sliding window 128 {KEPT}, 12 full attention: {CACHED}",
        ),
        (MISTRAL_7B_V01, f"mistral, 32 layers: sliding window 4096 {KEPT}: {CACHED}"),
        (QWEN2_7B, f"qwen2, 28 layers: full attention: {CACHED}"),
        (
            {**QWEN2_7B, "use_sliding_window": True, "max_window_layers": 21},
            f"qwen2, 28 layers: 21 full attention, 7 sliding window 131072 {KEPT}: {CACHED}",
        ),
        (
            LLAMA_4_SCOUT,
            f"llama4, 48 layers: 36 {LOCAL_8192}, 12 full attention: {CACHED}",
        ),
        (
            {**LLAMA_4_TEXT, "no_rope_layers": [1, 0] * 24},
            f"llama4_text, 48 layers: 24 {LOCAL_8192}, 24 full attention: {CACHED}",
        ),
        (DEEPSEEK_V3, f"deepseek_v3, 61 layers: MLA (kv_lora_rank 512): {MLA_ON_CPU}"),
        (LLAMA_3_8B, f"llama, 32 layers: full attention: {CACHED}"),
        (
            {"model_type": "nemotron_h", "hybrid_override_pattern": "*-*-"},
            "nemotron_h, 4 layers: 2 full attention, 2 without a KV cache (mlp): every "
            "attention layer cached",
        ),
        (
            {"model_type": "llama", "hidden_size": 4096},
            f"llama: full attention: {CACHED}",
        ),
        (JAMBA, f"jamba, 32 layers: 28 {STATE}, 4 full attention: {CACHED}; {AT_STATES}"),
        (
            NEMOTRON_H,
            f"nemotron_h, 55 layers: 25 {STATE}, 25 without a KV cache (mlp), 5 full "
            f"attention: {CACHED}; {AT_STATES}",
        ),
        (
            QWEN3_NEXT,
            "qwen3_next, 48 layers: 36 state-space (linear attention) (kept: the state at a "
            f"chunk's end), 12 full attention: {CACHED}; {AT_STATES}",
        ),
        (
            {"model_type": "falcon_h1", "num_hidden_layers": 24, "mamba_d_ssm": 1024},
            "falcon_h1, 24 layers: attention and state-space (mamba_d_ssm) (kept: the state "
            f"at a chunk's end): {CACHED}; {AT_STATES}",
        ),
    ],
    ids=[
        "gemma-3-1b", "gemma-3-4b", "gpt-oss", "mistral-7b-v0.1", "qwen2", "qwen2-window",
        "llama-4", "llama-4-no-rope-layers", "deepseek-v3", "llama-3", "attention-and-mlp",
        "no-layer-count", "jamba", "nemotron-h", "qwen3-next", "falcon-h1",
    ],
)  # fmt: skip
def test_what_kvpool_caches(config: dict[str, Any], seen: str) -> None:
    check = check_model(config)

    assert (check.outcome, check.seen, check.fix) == (Outcome.PASS, seen, None)


FIX = (
    "serve this model without kvpool, or accept that it gets no hits; kvpool caches "
    "attention models (full, MLA, chunked local), sliding-window hybrids and state-space "
    "hybrids (state-space beside attention layers)"
)


@pytest.mark.parametrize(
    ("config", "seen"),
    [
        (
            MAMBA2,
            "mamba2, 64 layers: state-space (mamba2): kvpool keeps a state-space layer's "
            "state beside the attention KV of a chunk, and this model has no attention "
            f"layer; {NO_HITS}",
        ),
        (
            {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-"},
            f"nemotron_h, 4 layers: 2 {STATE}, 2 without a KV cache (mlp): kvpool keeps a "
            "state-space layer's state beside the attention KV of a chunk, and this model "
            f"has no attention layer; {NO_HITS}",
        ),
        (
            {
                "model_type": "mllama",
                "text_config": {
                    "model_type": "mllama_text_model",
                    "num_hidden_layers": 40,
                    "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
                },
            },
            "mllama, 40 layers: 32 full attention, 8 cross-attention: "
            f"kvpool cannot cache cross-attention layers; {NO_HITS}",
        ),
    ],
    ids=["mamba2", "nemotron-h-without-attention", "mllama"],
)
def test_what_kvpool_cannot_cache(config: dict[str, Any], seen: str) -> None:
    check = check_model(config)

    assert (check.outcome, check.seen, check.fix) == (Outcome.FAIL, seen, FIX)


def test_without_a_model_config_the_check_is_skipped() -> None:
    check = check_model(None)

    assert check.outcome is Outcome.SKIP
    assert check.seen == "no --model-config given (the model's directory or its config.json)"


def test_the_doctor_reads_the_model_even_when_discovery_fails(tmp_path: Path) -> None:
    """The model check needs no agent: with no way to the cluster, it still runs."""
    (tmp_path / "config.json").write_text(json.dumps(MAMBA2))
    env = {"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "absent")}

    diagnosis = run_doctor("--pool", "main", "--model-config", str(tmp_path), env=env)

    assert diagnosis.returncode == 1
    assert diagnosis.checks["service"].outcome == "FAIL"
    model = diagnosis.checks["model"]
    assert model.outcome == "FAIL"
    assert model.seen.startswith("mamba2, 64 layers: state-space (mamba2): ")
    assert model.fix == FIX
