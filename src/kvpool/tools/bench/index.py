"""``kvpool bench index``: what the pool-wide prefix index costs.

* query: routing 8k-token prompts (token ids → chunk keys → longest prefix per
  node → policy) against an index of ``--chunks`` chunks across ``--nodes``
  nodes, p50 and p99, by how much of the prompt is cached, and for a lookup
  with precomputed keys (no hashing). Goal: p50 <= 200 us with key hashing.
* memory: RSS growth per tracked chunk while the index fills, keys included
  (as decoded events deliver them).
* events: chunk events per second one index absorbs. In process (decode and
  apply, no sockets), and over ZMQ: ``--publishers`` processes, each a real
  :class:`~kvpool.agent.edge.events.EventPublisher` plus a stand-in agent that
  answers the index's snapshot, flood stored/removed events into one
  :class:`~kvpool.index.subscriber.EventSubscriber`. Two rates: while
  they publish (they compete with the index for CPUs), and once all are done
  (the queues draining: the index alone). Lost events would show as gaps.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

import msgspec
import zmq

from kvpool.agent.edge.events import EventPublisher
from kvpool.common import problems
from kvpool.common import protocol as p
from kvpool.common.auth import TokenAuthority
from kvpool.common.keys import chunk_keys
from kvpool.common.kube.discovery import AgentEndpoint
from kvpool.common.routing import RoutingPolicy
from kvpool.index.query import Query
from kvpool.index.service import IndexService
from kvpool.index.subscriber import EventSubscriber
from kvpool.index.tracker import PrefixTracker
from kvpool.tools.bench.index_data import (
    TENANT,
    fill,
    fingerprint,
    percentiles,
    store_prompts,
    time_each,
    tracked,
)
from kvpool.tools.bench.local.agent_process import INDEX_TOKEN
from kvpool.tools.bench.report import goal, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chunks", type=problems.number(int), default=1_000_000, help="chunks in the index"
    )
    parser.add_argument(
        "--nodes", type=problems.number(int), default=16, help="nodes the chunks spread over"
    )
    parser.add_argument(
        "--prompt-tokens", type=problems.number(int), default=8192, help="tokens per prompt"
    )
    parser.add_argument(
        "--chunk-tokens", type=problems.number(int), default=256, help="tokens per chunk"
    )
    parser.add_argument(
        "--queries", type=problems.number(int), default=2000, help="queries timed per case"
    )
    parser.add_argument(
        "--publishers", type=problems.number(int), default=8, help="agents publishing events"
    )
    parser.add_argument(
        "--events", type=problems.number(int), default=50_000, help="events per publisher"
    )
    parser.add_argument(
        "--keys-per-event", type=problems.number(int), default=8, help="chunk keys per event"
    )


def run(args: argparse.Namespace) -> None:
    print(
        query_report(args.chunks, args.nodes, args.prompt_tokens, args.chunk_tokens, args.queries)
    )
    print()
    print(events_report(args.publishers, args.events, args.keys_per_event))


# ------------------------------------------------------------------ queries


def _route_goal(name: str, samples: list[float]) -> str:
    """A route's goal (p50 <= 200 us), marked where missed; none for the other measures."""
    if not name.startswith("route"):
        return ""
    return goal("p50 <= 200 us", sorted(samples)[len(samples) // 2] * 1e6, 200)


def query_report(chunks: int, nodes: int, tokens: int, chunk_tokens: int, queries: int) -> str:
    model = fingerprint(chunk_tokens)
    tracker = PrefixTracker(max_chunks_per_node=chunks)
    prompts = store_prompts(tracker, model, nodes, tokens)
    filled = fill(tracker, chunks, nodes, tokens // chunk_tokens)
    service = IndexService(tracker, RoutingPolicy())
    loads = {f"node-{n}": float(n % 4) for n in range(nodes)}

    def route(prompt: list[int]) -> object:
        return service.route(Query.of_tokens(prompt, TENANT, model), loads)

    def lookup_keys(keys: list[bytes]) -> object:
        return service.lookup(Query.of_keys(keys, chunk_tokens))

    def hash_only(prompt: list[int]) -> object:
        return chunk_keys(prompt, TENANT, model)

    whole = service.lookup(Query.of_tokens(prompts.full[0], TENANT, model))
    assert whole[0].tokens == tokens - tokens % chunk_tokens, "a stored prompt did not match"
    precomputed = [chunk_keys(prompt, TENANT, model) for prompt in prompts.full]
    cases = [
        ("route, whole prompt cached", time_each(route, prompts.full, queries)),
        ("route, first half cached", time_each(route, prompts.half, queries)),
        ("route, nothing cached", time_each(route, prompts.miss, queries)),
        (
            "lookup, precomputed keys, whole prompt cached",
            time_each(lookup_keys, precomputed, queries),
        ),
        ("key hashing alone, whole prompt", time_each(hash_only, prompts.full, queries)),
    ]
    rows: list[Sequence[object]] = [
        [name, *percentiles(samples), _route_goal(name, samples)] for name, samples in cases
    ]
    rows.append(
        [
            "memory per tracked chunk (RSS growth, keys included)",
            f"{filled.rss_bytes / filled.chunks:.0f} B",
            "",
            "",
        ]
    )
    rows.append(
        [
            f"stored events of {tokens // chunk_tokens} keys, applied",
            f"{filled.chunks / filled.seconds:,.0f} chunks/s",
            "",
            "",
        ]
    )
    return table(
        f"Prefix index: {tracked(tracker):,} chunks on {nodes} nodes, {tokens}-token prompts, "
        f"{chunk_tokens}-token chunks",
        ["measure", "p50", "p99", "goal"],
        rows,
    )


# ------------------------------------------------------------------- events


def _event_keys(publisher: int, keys_per_event: int, sets: int) -> list[list[bytes]]:
    return [
        [hashlib.sha256(b"%d-%d-%d" % (publisher, s, k)).digest() for k in range(keys_per_event)]
        for s in range(sets)
    ]


def _publisher(pipe: Connection, number: int, events: int, keys_per_event: int) -> None:
    """A stand-in agent: a real EventPublisher, and a ROUTER that answers hello and snapshot."""
    agent_id = uuid.uuid4().hex
    publisher = EventPublisher(
        "tcp://127.0.0.1:*", agent_id, TokenAuthority({"indexes": INDEX_TOKEN})
    )
    publisher.start()
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    pipe.send((router.getsockopt_string(zmq.LAST_ENDPOINT), publisher.bound_endpoint))

    def answer() -> None:
        while router.poll(0):
            identity, body = router.recv_multipart()
            request = p.decode_request(body)
            reply: p.Reply
            if isinstance(request, p.Hello):
                reply = p.HelloReply(
                    request.req, p.PROTOCOL_VERSION, 1, agent_id, "", 0, 0, 0, 0, 0
                )
            else:
                reply = p.SnapshotReply(request.req, agent_id, publisher.seq, {})
            router.send_multipart([identity, p.encode(reply)])

    key_sets = _event_keys(number, keys_per_event, 256)
    while not pipe.poll(0.01):
        answer()
    pipe.recv()  # go
    for event in range(events):
        keys = key_sets[(event // 2) % len(key_sets)]
        if event % 2:
            publisher.removed(TENANT, keys, "watermark")
        else:
            publisher.stored(TENANT, keys)
        if event % 1000 == 0:
            answer()
    pipe.send("done")
    while not pipe.poll(0.01):
        answer()
    publisher.stop()
    router.close()


def _in_process_rate(events: int, keys_per_event: int) -> float:
    key_sets = _event_keys(0, keys_per_event, 256)
    encoder = msgspec.msgpack.Encoder()
    frames = [
        encoder.encode(
            p.ChunkEvent(
                n + 1,
                "agent",
                "removed" if n % 2 else "stored",
                "l1",
                TENANT,
                key_sets[(n // 2) % len(key_sets)],
            )
        )
        for n in range(events)
    ]
    tracker = PrefixTracker()
    started = time.perf_counter()
    for frame in frames:
        event = p.decode_event(frame)
        if event.kind == "stored":
            tracker.stored("node", event.keys)
        else:
            tracker.removed("node", event.keys)
    return events / (time.perf_counter() - started)


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def events_report(publishers: int, events: int, keys_per_event: int) -> str:
    in_process = _in_process_rate(min(events, 200_000), keys_per_event)
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for number in range(publishers):
        parent, child = context.Pipe()
        process = context.Process(
            target=_publisher, args=(child, number, events, keys_per_event), daemon=True
        )
        process.start()
        pipes.append(parent)
        processes.append(process)
    endpoints = [AgentEndpoint(f"node-{number}", *pipe.recv()) for number, pipe in enumerate(pipes)]
    tracker = PrefixTracker()
    subscriber = EventSubscriber(tracker, token=INDEX_TOKEN)
    subscriber.start()
    try:
        subscriber.follow(endpoints)
        synced = _wait(
            lambda: sum(status.synced for status in subscriber.status()) == publishers, 30
        )
        assert synced, "the stand-in agents did not answer the snapshot requests"
        time.sleep(0.5)  # let every SUB socket's subscription reach its publisher

        def applied() -> int:
            return sum(status.events for status in subscriber.status())

        for pipe in pipes:
            pipe.send("go")
        started = time.perf_counter()
        for pipe in pipes:
            pipe.recv()
        published = time.perf_counter()
        at_published = applied()
        total = publishers * events
        drained = _wait(lambda: applied() >= total, 120)
        finished = time.perf_counter()
        gaps = sum(status.resyncs["gap"] for status in subscriber.status())
        at_end = applied()
    finally:
        for pipe in pipes:
            pipe.send("stop")
        for process in processes:
            process.join(10)
        subscriber.stop()
    drain_rate = (at_end - at_published) / max(finished - published, 1e-9)
    rows = [
        ["in process: decode + apply, no sockets", f"{in_process:,.0f} events/s", ""],
        [
            f"over ZMQ, {publishers} publishers, while publishing",
            f"{at_published / (published - started):,.0f} events/s",
            f"{at_published:,} of {total:,} applied",
        ],
        [
            "over ZMQ, queues draining after publishers finished",
            f"{drain_rate:,.0f} events/s",
            "all applied" if drained else f"{at_end:,} of {total:,} applied",
        ],
        ["gaps seen (lost events, each a resync)", str(gaps), ""],
        ["CPUs on this machine", str(os.cpu_count()), ""],
    ]
    return table(
        f"Chunk events absorbed by one index ({keys_per_event} keys per event)",
        ["measure", "value", "note"],
        rows,
    )
