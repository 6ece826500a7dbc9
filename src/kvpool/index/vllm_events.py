"""vLLM's KV-event messages, decoded and encoded without vLLM (the index image has none).

A message is three ZMQ frames ``[topic, seq, batch]``: ``seq`` an 8-byte big-endian
counter per publisher process (0 after a restart), ``batch`` msgpack ``[ts, events,
dp_rank]`` (vLLM's ``KVEventBatch``, an array). Each event is a msgpack map tagged by
``"type"`` (vLLM 0.30 on, PR #42892) or, from older engines, a positional array whose
first element is the tag: both are read. Fields this index does not use are ignored, so
newer engines that add fields still decode; an event of an unknown type is one
:class:`UndecodableEvent` and the rest of its batch still counts.

The index writes the same wire (:mod:`kvpool.index.placement_events`): maps tagged
``"type"`` with every field, and batches ``[ts, events]``, which vLLM 0.30 to 0.33's own
``KVEventBatch`` decodes (``tests/index/test_vllm_wire.py``, on every release of the vLLM
matrix, checks both directions).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""The sequence frame that ends a replay."""
BlockHash = int | Annotated[bytes, msgspec.Meta(max_length=64)]
"""vLLM's external block hash: the low 64 bits of the digest as an int (its default), or
the digest's bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). msgpack's integers are
64-bit at most: no bound needed for ints."""
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class BlockStored(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    """Per block: None, or what the block's hash mixed in besides its tokens (LoRA name,
    multimodal ``[identifier, offset]`` pairs, the request's ``cache_salt`` on its first
    block, prompt-embedding digests), untagged."""
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def _positional(event: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """``event`` as older engines send it: a positional array whose first element is the tag."""
    fields = [
        (f.name, f.type) if f.required else (f.name, f.type, f.default)
        for f in msgspec.structs.fields(event)
    ]
    return msgspec.defstruct(
        f"Positional{event.__name__}", fields, array_like=True, tag=event.__name__, frozen=True
    )


_FROM_POSITIONAL = {
    _positional(event): event for event in (BlockStored, BlockRemoved, AllBlocksCleared)
}


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A batch to encode (one publisher's, so no data-parallel rank)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class _Batch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class UndecodableEvent(msgspec.Struct, frozen=True):
    """One event of a batch that did not decode (kept so that the batch's others count)."""

    error: str


_batch = msgspec.msgpack.Decoder(_Batch)
_event = msgspec.msgpack.Decoder(Event)
_positional_event = msgspec.msgpack.Decoder(Union[tuple(_FROM_POSITIONAL)])  # noqa: UP007


class WireError(ValueError):
    """A message that is not a vLLM KV-event batch."""


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise WireError(f"sequence frame of {len(frame)} bytes, not {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def decode_batch(payload: bytes) -> list[Event | UndecodableEvent]:
    """The events of one batch, in order; WireError if it is not a batch at all."""
    try:
        batch = _batch.decode(payload)
    except msgspec.MsgspecError as error:
        raise WireError(f"not a KV-event batch: {error}") from None
    return [_decode_event(raw) for raw in batch.events]


def _decode_event(raw: msgspec.Raw) -> Event | UndecodableEvent:
    try:
        return _event.decode(raw)
    except msgspec.MsgspecError as error:
        try:
            positional = _positional_event.decode(raw)
        except msgspec.MsgspecError:
            return UndecodableEvent(str(error))
    event: Event = _FROM_POSITIONAL[type(positional)](**msgspec.structs.asdict(positional))
    return event
