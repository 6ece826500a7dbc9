"""The model check: what kvpool does with each kind of layer of a model, read from its
config.json alone (no vLLM, no transformers: the doctor runs with the agent install).

The connector caches every KV cache group vLLM gives it when it knows the group's kind
(:mod:`kvpool.connector.groups`): full attention and MLA (every block of a chunk),
sliding windows (the window's blocks), chunked local attention (every block), and the state
of state-space layers (Mamba, linear attention, short convolutions) beside attention layers,
where vLLM's prefix caching keeps one. Models of state-space layers alone, cross-attention
and kinds it does not know make it serve that engine no hits. This check tells which,
before the engine starts.

The kinds come from the config's fields, not the model's name: ``layer_types``;
``hybrid_override_pattern`` (Nemotron-H); ``layers_block_type``; ``attn_layer_period`` and
``attn_layer_offset`` (Jamba); ``attn_layer_indices`` (Bamba); ``attn_type_list``
(MiniMax); ``sliding_window`` with ``use_sliding_window``, ``max_window_layers`` (Qwen2)
and ``sliding_window_pattern``; ``attention_chunk_size`` with ``no_rope_layers`` (Llama
4); ``kv_lora_rank`` (MLA); ``cross_attention_layers`` and ``is_encoder_decoder``. A
multimodal config's language model (``text_config``) is the one read. Where a field is
left out, transformers' default for the model type applies, as it does in vLLM.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvpool.common.problems import ConfigError, show
from kvpool.tools.doctor.report import Check, failed, passed, skipped

NAME = "model"
FLAG = "--model-config"

Kept = Literal["cached", "state", "no-cache", "refused"]
"""What kvpool does with a kind: caches it, caches its state beside attention chunks (a
state-space layer: cached only in a model with attention layers), has nothing to cache (an
MLP layer), or cannot cache it (and then serves the engine no hits)."""


@dataclass(frozen=True)
class Kind:
    """One kind of layer, as the check line names it."""

    label: str
    kept: Kept
    group: str
    """What the verdict calls the kind when kvpool cannot cache it."""


FULL = Kind("full attention", "cached", "full attention")
STATE_SPACE = "state-space"
NO_HITS = "this engine gets no hits from kvpool (it still serves)"
FIX = (
    "serve this model without kvpool, or accept that it gets no hits; kvpool caches "
    "attention models (full, MLA, chunked local), sliding-window hybrids and state-space "
    "hybrids (state-space beside attention layers)"
)

_STATE_SPACE = frozenset(
    {
        "mamba", "mamba2", "ssm", "linear_attention", "linear", "conv", "short_conv",
        "deltanet", "gated_deltanet", "kda", "lightning_attention", "hybrid", "rwkv",
    }
)  # fmt: skip
_STATE_SPACE_MODEL_TYPES = ("mamba", "rwkv", "xlstm")
"""Model types of state-space layers alone (no attention)."""
_STATE_SPACE_FIELDS = ("mamba_", "ssm_", "linear_")
"""Fields of a model whose layers hold state-space mixers (beside attention, as Falcon-H1's
do, where no field says which layer has which)."""
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
_NO_CACHE = frozenset({"mlp", "moe", "ffn", "dense"})
_FULL_NAMES = frozenset({"full_attention", "attention", "global_attention", "full", "global"})
_WINDOW_NAMES = frozenset({"sliding_attention", "sliding_window_attention", "sliding_window"})
_NEMOTRON_H = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}

_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
"""transformers' ``sliding_window_pattern`` where a model type's config.json leaves it out:
every Nth layer has full attention, the others a sliding window."""
_NO_ROPE_INTERVAL = {"llama4": 4, "llama4_text": 4}
"""transformers' ``no_rope_layer_interval`` for Llama 4: every Nth layer has full
attention (no RoPE), the others chunked local attention."""


@dataclass(frozen=True)
class ModelLayers:
    model_type: str
    layers: Sequence[Kind]
    """One kind per layer; a single kind when the config does not say how many layers."""
    counted: bool
    """The config says how many layers there are."""
    kv_lora_rank: int | None


def read_model_config(path: Path) -> dict[str, Any]:
    """The model's config.json (``path``, or ``path/config.json`` for a model directory);
    :class:`ConfigError` in one line naming the file if it cannot be read."""
    file = path / "config.json" if path.is_dir() else path
    try:
        text = file.read_bytes()
    except OSError as error:
        raise ConfigError([f"{FLAG} {show(file)}: cannot read it: {error.strerror}"]) from None
    try:
        config = json.loads(text)
    except ValueError as error:
        raise ConfigError([f"{FLAG} {show(file)}: not JSON: {error}"]) from None
    if not isinstance(config, dict):
        kind = type(config).__name__
        problem = f"not a model's config.json (a JSON object, not {kind})"
        raise ConfigError([f"{FLAG} {show(file)}: {problem}"])
    return config


def check_model(config: Mapping[str, Any] | None) -> Check:
    if config is None:
        return skipped(NAME, f"no {FLAG} given (the model's directory or its config.json)")
    model = classify(config)
    counts = Counter(model.layers)
    kinds = ", ".join(
        kind.label if len(counts) == 1 else f"{count} {kind.label}"
        for kind, count in counts.items()
    )
    size = f", {len(model.layers)} layers" if model.counted else ""
    seen = f"{model.model_type}{size}: {kinds}"
    refused = list(dict.fromkeys(kind.group for kind in counts if kind.kept == "refused"))
    if refused:
        return failed(
            NAME,
            f"{seen}: kvpool cannot cache {_joined(refused)} layers; {NO_HITS}",
            FIX,
        )
    states = any(kind.group == STATE_SPACE for kind in counts)
    if states and not any(kind.kept == "cached" for kind in counts):
        return failed(
            NAME,
            f"{seen}: kvpool keeps a state-space layer's state beside the attention KV of a "
            f"chunk, and this model has no attention layer; {NO_HITS}",
            FIX,
        )
    if states:
        return passed(
            NAME,
            f"{seen}: every layer cached; a hit ends where vLLM's prefix caching kept the "
            "state-space layers' state (by default the last block boundary before a prompt's "
            "end; none with speculative decoding)",
        )
    if model.kv_lora_rank is not None:
        return passed(
            NAME,
            f"{seen}: cached on GPUs; on a CPU without AMX vLLM runs MLA without prefix "
            "caching and kvpool serves no hits",
        )
    if any(kind.kept == "no-cache" for kind in counts):
        return passed(NAME, f"{seen}: every attention layer cached")
    return passed(NAME, f"{seen}: every layer cached")


def classify(config: Mapping[str, Any]) -> ModelLayers:
    """The kind of each layer of the model ``config`` describes."""
    text = _language_model(config)
    model_type = _text(config.get("model_type")) or _text(text.get("model_type")) or "?"
    text_type = _text(text.get("model_type")) or model_type
    rank = _count(text.get("kv_lora_rank"))
    full = Kind(f"MLA (kv_lora_rank {rank})", "cached", "MLA") if rank is not None else FULL
    numbers = (_count(text.get(key)) for key in _LAYER_COUNTS)
    layers = _per_layer(text, text_type, full, next((n for n in numbers if n), None))
    counted = layers is not None
    if layers is None:
        layers = [_uniform(text, text_type, full)]
    crossed = text.get("cross_attention_layers")
    if counted and isinstance(crossed, list):
        cross = Kind("cross-attention", "refused", "cross-attention")
        layers = [cross if i in crossed else kind for i, kind in enumerate(layers)]
    if config.get("is_encoder_decoder") is True or text.get("is_encoder_decoder") is True:
        cross = Kind("encoder-decoder cross-attention", "refused", "cross-attention")
        layers = [cross if kind.kept == "cached" else kind for kind in layers]
    return ModelLayers(model_type, layers, counted, rank)


def _language_model(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal config's language model; ``config`` itself otherwise."""
    for key in ("text_config", "llm_config", "language_config"):
        inner = config.get(key)
        if isinstance(inner, dict):
            return inner
    return config


def _per_layer(
    config: Mapping[str, Any], model_type: str, full: Kind, number: int | None
) -> list[Kind] | None:
    """Each layer's kind, from the fields that list or pattern them; None where the config
    says neither how many layers there are nor which is which."""
    named = _strings(config.get("layer_types"))
    if named is not None:
        return [_named(config, name, full) for name in named]
    pattern = config.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return [_named(config, _NEMOTRON_H.get(char, char), full) for char in pattern]
    blocks = _strings(config.get("layers_block_type"))
    if blocks is not None:
        return [_named(config, name, full) for name in blocks]
    if number is None:
        return None
    period, offset = _count(config.get("attn_layer_period")), config.get("attn_layer_offset")
    if period is not None and isinstance(offset, int):
        return [full if i % period == offset else _state_space("mamba") for i in range(number)]
    indices = config.get("attn_layer_indices")
    if isinstance(indices, list) and indices:
        return [full if i in indices else _state_space("mamba") for i in range(number)]
    types = config.get("attn_type_list")
    if isinstance(types, list) and len(types) == number:
        return [full if kind == 1 else _state_space("linear_attention") for kind in types]
    state = _state_space_marker(config, model_type)
    if state is not None:
        return [state] * number
    return [_attention(config, model_type, full, i) for i in range(number)]


def _uniform(config: Mapping[str, Any], model_type: str, full: Kind) -> Kind:
    """The one kind of a config that does not say how many layers it has."""
    return _state_space_marker(config, model_type) or _attention(config, model_type, full, 0)


def _state_space_marker(config: Mapping[str, Any], model_type: str) -> Kind | None:
    """The state-space kind of every layer of a model whose type or fields say it has one."""
    if any(marker in model_type for marker in _STATE_SPACE_MODEL_TYPES):
        return Kind(f"state-space ({model_type})", "state", STATE_SPACE)
    field = next((key for key in config if key.startswith(_STATE_SPACE_FIELDS)), None)
    if field is not None:  # each layer has attention beside its state-space mixer
        return Kind(f"attention and state-space ({field}){_STATE_KEPT}", "cached", STATE_SPACE)
    return None


def _attention(config: Mapping[str, Any], model_type: str, full: Kind, layer: int) -> Kind:
    """Layer ``layer`` of an attention-only model without ``layer_types``."""
    chunk = _count(config.get("attention_chunk_size"))
    if chunk is not None:
        no_rope = config.get("no_rope_layers")
        if isinstance(no_rope, list) and len(no_rope) > layer:
            return _local(chunk) if no_rope[layer] else full
        interval = _count(config.get("no_rope_layer_interval"))
        interval = interval or _NO_ROPE_INTERVAL.get(model_type)
        if interval is not None and (layer + 1) % interval == 0:
            return full
        return _local(chunk)
    window = _window(config)
    if window is None:
        return full
    if "max_window_layers" in config and "use_sliding_window" in config:
        # Qwen2: the layers from max_window_layers on have the window (when it is on)
        bottom = _count(config.get("max_window_layers")) or 0
        return _sliding(window) if layer >= bottom else full
    pattern = _count(config.get("sliding_window_pattern")) or _WINDOW_PATTERN.get(model_type)
    if pattern is not None and (layer + 1) % pattern == 0:
        return full
    return _sliding(window)


def _named(config: Mapping[str, Any], name: str, full: Kind) -> Kind:
    """A layer that ``layer_types`` (or a pattern) names."""
    key = name.lower()
    if key in _FULL_NAMES:
        return full
    if key in _WINDOW_NAMES:
        return _sliding(_count(config.get("sliding_window")))
    if key == "chunked_attention":
        return _local(_count(config.get("attention_chunk_size")))
    if key in _STATE_SPACE:
        return _state_space(key)
    if key in _NO_CACHE:
        return Kind(f"without a KV cache ({key})", "no-cache", key)
    if key == "cross_attention":
        return Kind("cross-attention", "refused", "cross-attention")
    return Kind(f"{name} (a kind kvpool does not know)", "refused", name)


def _window(config: Mapping[str, Any]) -> int | None:
    """The sliding window, unless the config turns it off."""
    if config.get("use_sliding_window") is False:
        return None
    return _count(config.get("sliding_window"))


def _sliding(window: int | None) -> Kind:
    size = f" {window}" if window is not None else ""
    return Kind(
        f"sliding window{size} (kept: the window's blocks of each chunk)", "cached", "window"
    )


def _local(chunk: int | None) -> Kind:
    size = f" {chunk}" if chunk is not None else ""
    return Kind(
        f"chunked local attention{size} (cached if chunk_tokens divides it)",
        "cached",
        "chunked local attention",
    )


_STATE_KEPT = " (kept: the state at a chunk's end)"


def _state_space(name: str) -> Kind:
    return Kind(f"state-space ({name.replace('_', ' ')}){_STATE_KEPT}", "state", STATE_SPACE)


def _count(value: object) -> int | None:
    """A positive whole number, or None (absent, null, or something else)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _strings(value: object) -> list[str] | None:
    """A list of strings, not empty; None for anything else."""
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return value
    return None


def _joined(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
