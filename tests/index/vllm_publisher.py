"""A stand-in for vLLM's KV-event publisher, speaking its wire format with vLLM's own classes:
an XPUB (so a test knows when the index subscribed) and a replay ROUTER served by a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

__all__ = ["AllBlocksCleared", "BlockRemoved", "Publisher", "stored"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC = b"kv@test@tiny"


def stored(
    hashes: Sequence[int | bytes],
    parent: int | bytes | None,
    tokens: Sequence[int],
    *,
    block_size: int,
    salt: str | None = None,
    **fields: Any,
) -> BlockStored:
    """A BlockStored as vLLM builds it: the salt in the first block's extra keys."""
    extra: list[tuple[Any, ...] | None] | None = None
    if salt is not None and parent is None:
        extra = [(salt,)] + [None] * (len(hashes) - 1)
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=fields.pop("lora_id", None),
        medium=fields.pop("medium", "GPU"),
        lora_name=fields.pop("lora_name", None),
        extra_keys=fields.pop("extra_keys", extra),
        **fields,
    )


class Publisher:
    def __init__(self, *, replay: bool = False) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.pub = self._context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = -1
        self.history: list[tuple[int, bytes]] = []
        self.replay_endpoint: str | None = None
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            router = self._context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind("tcp://127.0.0.1:0")
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Wait for a subscription (an unsubscription, a peer that left, is skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.pub.poll(int(left * 1000)), "nobody subscribed"
            if self.pub.recv()[:1] == b"\x01":
                return

    def publish(
        self,
        *events: BlockStored | BlockRemoved | AllBlocksCleared,
        seq: int | None = None,
        send: bool = True,
    ) -> int:
        """One batch, at ``seq`` (default: the next); ``send=False`` keeps it for replay only
        (as if the subscriber's queue had dropped it)."""
        self.seq = self.seq + 1 if seq is None else seq
        payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=list(events)))
        self.history.append((self.seq, payload))
        if send:
            self.raw([TOPIC, self.seq.to_bytes(8, "big"), payload])
        return self.seq

    def raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve(self, router: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                client, _, start = router.recv_multipart()
                first = int.from_bytes(start, "big")
                self.replay_requests.append(first)
                for seq, payload in list(self.history):
                    if seq >= first:
                        router.send_multipart([client, b"", TOPIC, seq.to_bytes(8, "big"), payload])
                router.send_multipart([client, b"", b"", END_SEQ, b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.pub.close(linger=0)
