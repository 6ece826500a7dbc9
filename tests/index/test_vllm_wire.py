"""kvpool's vLLM KV-event wire (:mod:`kvpool.index.vllm_events`) against the installed vLLM's
own classes, both ways: what the index publishes (placement events) decodes as vLLM's
``KVEventBatch``, and what vLLM's publisher encodes decodes as the index reads it. The
vLLM matrix (``make test-matrix``) runs this file on every supported release."""

from __future__ import annotations

import msgspec
import pytest

from kvpool.index.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
)

kv_events = pytest.importorskip("vllm.distributed.kv_events")


def test_the_published_events_decode_as_vllms_own() -> None:
    batch = EventBatch(
        1.5,
        [
            BlockStored([1, 2], None, [], 16, None, "KVPOOL_L1", None),
            BlockRemoved([b"\x07" * 32], "KVPOOL_NVME"),
            AllBlocksCleared(),
        ],
    )
    decoded = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch).decode(
        msgspec.msgpack.encode(batch)
    )
    stored, removed, cleared = decoded.events
    assert isinstance(stored, kv_events.BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash, stored.block_size) == ([1, 2], None, 16)
    assert (stored.token_ids, stored.medium) == ([], "KVPOOL_L1")
    assert isinstance(removed, kv_events.BlockRemoved)
    assert (removed.block_hashes, removed.medium) == ([b"\x07" * 32], "KVPOOL_NVME")
    assert isinstance(cleared, kv_events.AllBlocksCleared)


def test_vllms_own_events_decode_as_the_index_reads_them() -> None:
    fields = {f.name for f in msgspec.structs.fields(kv_events.BlockStored)}
    stored_args = {
        "block_hashes": [11, 12],
        "parent_block_hash": 10,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
    }
    stored_args.update(
        {name: None for name in ("lora_name", "extra_keys", "group_idx") if name in fields}
    )
    vllm_batch = kv_events.KVEventBatch(
        ts=2.5,
        events=[
            kv_events.BlockStored(**stored_args),
            kv_events.BlockRemoved(block_hashes=[12], medium="GPU"),
            kv_events.AllBlocksCleared(),
        ],
    )
    stored, removed, cleared = decode_batch(msgspec.msgpack.encode(vllm_batch))
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash) == ([11, 12], 10)
    assert (stored.token_ids, stored.block_size, stored.medium) == (list(range(32)), 16, "GPU")
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [12]
    assert isinstance(cleared, AllBlocksCleared)
