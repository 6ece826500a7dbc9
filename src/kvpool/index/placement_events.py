"""The pool's placements as vLLM KV events, for routers that read vLLM's own.

llm-d's precise prefix scorer and Dynamo's KV router learn where KV lives from vLLM's KV
events. This publisher speaks the same wire, so they see kvpool's tiers unchanged: per model
server, on the topic ``kv@<server ip>@<model>`` (llm-d's convention, one topic per pod),
``BlockStored`` for the blocks that server can load from kvpool, ``BlockRemoved`` when they
go, each with a ``medium`` that names the tier (:class:`Medium`). Block hashes are vLLM's
own (the engines' events name them), so a router joins these with the GPU events it already
has; ``token_ids`` is empty, which such routers read as "a tier of blocks you know".

The wire, as vLLM 0.30 to 0.33 publish it (``vllm.distributed.kv_events``; written with
:mod:`kvpool.index.vllm_events`):

* PUB, three frames: the topic, ``seq`` as 8 bytes big-endian (one counter for the whole
  publisher, +1 per batch), and a msgpack ``KVEventBatch``: an array ``[ts, events]``
  whose events are maps tagged ``"type"``. The PUB binds ``endpoint``, or connects to it
  with ``connect`` (so that a router's bound SUB collects every publisher, as vLLM's
  publisher connects to an endpoint without a wildcard).
* Recovery, on a ROUTER at ``replay_endpoint``, from a DEALER:

  - ``[b"", seq]`` (8 bytes big-endian): every batch still buffered from ``seq`` on, each as
    ``[b"", topic, seq, payload]``, then the end marker ``[b"", b"", -1, b""]`` (vLLM's
    replay);
  - ``[b"", b"snapshot"]``: the whole state, per topic an ``AllBlocksCleared`` then every
    placement, parents before children, each batch framed ``[b"", topic, resume, payload]``
    where ``resume`` is the ``seq`` of the next live batch, then the end marker (the framing
    vLLM's pull request #50134 proposes). A restarted consumer takes a snapshot, then
    follows the live stream from ``resume`` (asking for a replay of anything it missed
    in between).

Who may read: anyone who reaches the ports, as with vLLM's own publisher; the pool's
NetworkPolicy admits the routers. The events carry vLLM's block hashes and the tier, never
token ids, salts or tenant ids.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from kvpool.index.vllm_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    encode_seq,
)

log = logging.getLogger(__name__)

SNAPSHOT_REQUEST = b"snapshot"
SNAPSHOT_BATCH_EVENTS = 1024
"""Placements per batch of a snapshot, so that no message grows with the pool."""


class Medium(enum.StrEnum):
    """The tier a placement is in, as the ``medium`` of its events."""

    L1 = "KVPOOL_L1"
    """The server's node's L1 (shared memory)."""
    NVME = "KVPOOL_NVME"
    """The server's node's NVMe."""
    S3 = "KVPOOL_S3"
    """The pool's S3 bucket (every server can load it)."""


@dataclass(frozen=True, slots=True)
class Block:
    """One vLLM block a server can load: its hash, its parent's, its size in tokens."""

    block_hash: BlockHash
    parent: BlockHash | None
    block_size: int


@dataclass(frozen=True)
class PublisherStatus:
    """The publisher's counters, for the index's metrics."""

    seq: int
    """The seq of the next batch: the batches published since the publisher started."""
    dropped: int
    """Batches not sent because the PUB socket was at its high-water mark (consumers see a
    gap, and may ask for a replay)."""
    requests: dict[str, int]
    """Recovery requests answered (``replay``, ``snapshot``) and ignored (``malformed``)."""
    placements: dict[str, int]
    """Placements held now, by medium (what a snapshot would list)."""
    topics: int
    """Model servers with some placement."""


def topic_of(server_ip: str, model: str) -> bytes:
    """llm-d's topic for a pod's events: ``kv@<pod ip>@<model>``."""
    return f"kv@{server_ip}@{model}".encode()


class _Placements:
    """What each topic holds now, per medium, in the order it was stored (parents first)."""

    def __init__(self) -> None:
        self.topics: dict[bytes, dict[str, dict[BlockHash, Block]]] = {}

    def store(self, topic: bytes, medium: str, blocks: Sequence[Block]) -> list[Block]:
        held = self.topics.setdefault(topic, {}).setdefault(medium, {})
        new = [block for block in blocks if block.block_hash not in held]
        for block in new:
            held[block.block_hash] = block
        return new

    def remove(self, topic: bytes, medium: str, hashes: Iterable[BlockHash]) -> list[BlockHash]:
        held = self.topics.get(topic, {}).get(medium, {})
        return [block_hash for block_hash in hashes if held.pop(block_hash, None) is not None]

    def clear(self, topic: bytes) -> bool:
        return self.topics.pop(topic, None) is not None


class PlacementPublisher:
    """Publish placements per topic on vLLM's wire, with replay and snapshots.

    Thread safety: every method may be called from any thread; sockets are used by the
    publisher's own thread only (ZMQ sockets are not thread-safe), fed through a queue.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        connect: bool = False,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._connect = connect
        self._hwm = hwm
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._lock = threading.Lock()
        self._placements = _Placements()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self._outbox: deque[tuple[bytes, bytes, bytes]] = deque()
        self._seq = 0
        """The seq of the next batch."""
        self._dropped = 0
        self._requests = dict.fromkeys(("replay", "snapshot", "malformed"), 0)
        self._encoder = msgspec.msgpack.Encoder()
        self._wake_endpoint = f"inproc://kvpool-placements-{id(self):x}"
        self._thread: threading.Thread | None = None
        self._wake: zmq.Socket[bytes] | None = None
        self.bound_endpoint = ""
        self.bound_replay_endpoint = ""

    # ------------------------------------------------------------- interface

    def start(self) -> None:
        """Bind (or connect) the sockets and start publishing; ``OSError`` (one line) if an
        endpoint cannot be bound."""
        pub: zmq.Socket[bytes] = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        replay: zmq.Socket[bytes] | None = None
        try:
            if self._connect:
                pub.connect(self._endpoint)
                self.bound_endpoint = self._endpoint
            else:
                pub.bind(self._endpoint)
                self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self._replay_endpoint is not None:
                replay = self._context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.MAXMSGSIZE, 64)  # a request is a seq or "snapshot"
                # A reader that does not read loses what is past this (ROUTER drops, never
                # blocks): a replay of the whole buffer, or a snapshot of a million blocks.
                replay.setsockopt(zmq.SNDHWM, 2 * (self._buffer.maxlen or 0) + 4096)
                replay.bind(self._replay_endpoint)
                self.bound_replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as error:
            pub.close()
            if replay is not None:
                replay.close()
            raise OSError(error.errno, f"{error.strerror}: placement events") from None
        wake: zmq.Socket[bytes] = self._context.socket(zmq.PULL)
        wake.bind(self._wake_endpoint)
        self._wake = self._context.socket(zmq.PUSH)
        self._wake.connect(self._wake_endpoint)
        self._thread = threading.Thread(
            target=self._run, args=(pub, replay, wake), name="kvpool-placements", daemon=True
        )
        self._thread.start()
        log.info("placement events on %s (replay: %s)", self.bound_endpoint, self._replay_endpoint)

    def stop(self) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._signal(b"stop")
        self._thread.join()
        self._thread = None
        with self._lock:
            if self._wake is not None:
                self._wake.close()
                self._wake = None

    def stored(self, topic: bytes, medium: Medium, blocks: Sequence[Block]) -> None:
        """``topic``'s server can now load ``blocks`` (parents first) from ``medium``."""
        with self._lock:
            new = self._placements.store(topic, medium, blocks)
            if new:
                self._enqueue(topic, [_stored(medium, run) for run in _runs(new)])

    def removed(self, topic: bytes, medium: Medium, block_hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            gone = self._placements.remove(topic, medium, block_hashes)
            if gone:
                self._enqueue(topic, [BlockRemoved(gone, str(medium))])

    def replace(self, topic: bytes, medium: Medium, blocks: Sequence[Block]) -> None:
        """``topic``'s server can load exactly ``blocks`` from ``medium`` now: what went is
        removed, what is new stored."""
        with self._lock:
            held = self._placements.topics.get(topic, {}).get(medium, {})
            wanted = {block.block_hash for block in blocks}
            gone = self._placements.remove(topic, medium, [h for h in held if h not in wanted])
            new = self._placements.store(topic, medium, blocks)
            events: list[Event] = [BlockRemoved(gone, str(medium))] if gone else []
            events.extend(_stored(medium, run) for run in _runs(new))
            if events:
                self._enqueue(topic, events)

    def cleared(self, topic: bytes) -> None:
        """``topic``'s server can load nothing from kvpool (it left, or its node did)."""
        with self._lock:
            if self._placements.clear(topic):
                self._enqueue(topic, [AllBlocksCleared()])

    def status(self) -> PublisherStatus:
        with self._lock:
            placements: dict[str, int] = dict.fromkeys(map(str, Medium), 0)
            for media in self._placements.topics.values():
                for medium, held in media.items():
                    placements[medium] = placements.get(medium, 0) + len(held)
            return PublisherStatus(
                self._seq,
                self._dropped,
                dict(self._requests),
                placements,
                len(self._placements.topics),
            )

    @property
    def seq(self) -> int:
        """The seq of the next batch."""
        with self._lock:
            return self._seq

    # --------------------------------------------------------------- internals

    def _enqueue(self, topic: bytes, events: list[Event]) -> None:
        """Under the lock: number, buffer and queue one batch for the thread to send (the
        lock also serialises the wake socket's senders)."""
        payload = self._encoder.encode(EventBatch(time.time(), events))
        seq = encode_seq(self._seq)
        self._buffer.append((self._seq, topic, payload))
        self._seq += 1
        self._outbox.append((topic, seq, payload))
        self._signal(b"send")

    def _signal(self, what: bytes) -> None:
        if self._wake is not None:
            self._wake.send(what)

    def _snapshot(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Under the lock: the resume seq and every topic's state as batches."""
        batches: list[tuple[bytes, bytes]] = []
        for topic, media in self._placements.topics.items():
            events: list[Event] = [AllBlocksCleared()]
            for medium, held in media.items():
                for run in _runs(list(held.values())):
                    events.append(_stored(medium, run))
            for start in range(0, len(events), SNAPSHOT_BATCH_EVENTS):
                chunk = events[start : start + SNAPSHOT_BATCH_EVENTS]
                batches.append((topic, self._encoder.encode(EventBatch(time.time(), chunk))))
        return self._seq, batches

    def _run(
        self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None, wake: zmq.Socket[bytes]
    ) -> None:
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if wake in ready and b"stop" in _drain(wake):
                    return
                self._send_outbox(pub)
                if replay is not None and replay in ready:
                    self._serve(replay)
        finally:
            for socket in (pub, replay, wake):
                if socket is not None:
                    socket.close()

    def _send_outbox(self, pub: zmq.Socket[bytes]) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    return
                frames = self._outbox.popleft()
            # past the high-water mark the batch is dropped: consumers see the gap
            try:
                pub.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                with self._lock:
                    self._dropped += 1

    def _serve(self, replay: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"":
                log.warning("placement events: a replay request of %d frames ignored", len(frames))
                self._count("malformed")
                continue
            client, request = frames[0], frames[2]
            if request == SNAPSHOT_REQUEST:
                self._count("snapshot")
                with self._lock:
                    resume, batches = self._snapshot()
                framed = [(topic, encode_seq(resume), data) for topic, data in batches]
            elif len(request) == 8:
                self._count("replay")
                start = int.from_bytes(request, "big")
                with self._lock:
                    framed = [
                        (topic, encode_seq(seq), data)
                        for seq, topic, data in self._buffer
                        if seq >= start
                    ]
            else:
                log.warning("placement events: a replay request of %d bytes ignored", len(request))
                self._count("malformed")
                continue
            for topic, seq_bytes, data in framed:
                replay.send_multipart((client, b"", topic, seq_bytes, data))
            replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _count(self, request: str) -> None:
        with self._lock:
            self._requests[request] += 1


def _drain(socket: zmq.Socket[bytes]) -> list[bytes]:
    signals = []
    while True:
        try:
            signals.append(socket.recv(zmq.NOBLOCK))
        except zmq.Again:
            return signals


def _runs(blocks: Sequence[Block]) -> list[list[Block]]:
    """Consecutive blocks that form one chain of one block size: one ``BlockStored`` each
    (vLLM's events name one parent, then each block is the previous one's child)."""
    runs: list[list[Block]] = []
    for block in blocks:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and block.parent == last.block_hash
            and block.block_size == last.block_size
        ):
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


def _stored(medium: str, run: Sequence[Block]) -> BlockStored:
    return BlockStored(
        block_hashes=[block.block_hash for block in run],
        parent_block_hash=run[0].parent,
        token_ids=[],
        block_size=run[0].block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )
