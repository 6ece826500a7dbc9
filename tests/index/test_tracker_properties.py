"""Property: the verified binary search equals a linear walk, on any history of a node.

Histories mix what agents publish (runs of one chain stored in order, possibly
skipping chunks already held), removals anywhere in a chain (a locked chunk
outliving its predecessor, lost events), snapshots in any order, dropped nodes
and a small cap that evicts chain heads before their tails.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.index.tracker import PrefixTracker

NODES = ("a", "b")
DEPTH = 12


def chain_of(path: tuple[int, ...]) -> list[bytes]:
    """Keys of a prompt whose chunks are ``path`` (prompts sharing a prefix share keys)."""
    return [hashlib.sha256(repr(path[: i + 1]).encode()).digest() for i in range(len(path))]


paths = st.lists(st.integers(0, 1), min_size=4, max_size=DEPTH).map(tuple)
prompt = st.integers(0, 3)
"""A prompt of the example's pool (by index): histories keep coming back to the same chains."""


@dataclass(frozen=True)
class Store:
    node: str
    prompt: int
    start: int
    skip: frozenset[int]
    """Chunks of the run the event leaves out (an agent publishes only those it newly stored)."""


@dataclass(frozen=True)
class Remove:
    node: str
    prompt: int
    positions: frozenset[int]


@dataclass(frozen=True)
class Replace:
    node: str
    prompts: tuple[int, ...]
    order: int


@dataclass(frozen=True)
class Drop:
    node: str


nodes = st.sampled_from(NODES)
operations = st.one_of(
    st.builds(
        Store,
        nodes,
        prompt,
        st.just(0) | st.integers(0, DEPTH),
        st.just(frozenset[int]()) | st.frozensets(st.integers(0, DEPTH - 1), max_size=2),
    ),
    st.builds(Remove, nodes, prompt, st.frozensets(st.integers(0, DEPTH - 1), max_size=3)),
    st.builds(Replace, nodes, st.lists(prompt, max_size=4).map(tuple), st.integers(0, 1000)),
    st.builds(Drop, nodes),
)


def apply(
    tracker: PrefixTracker, operation: Store | Remove | Replace | Drop, pool: list[list[bytes]]
) -> None:
    if isinstance(operation, Store):
        keys = pool[operation.prompt % len(pool)]
        run = range(operation.start, len(keys))
        tracker.stored(operation.node, [keys[i] for i in run if i not in operation.skip])
    elif isinstance(operation, Remove):
        keys = pool[operation.prompt % len(pool)]
        tracker.removed(operation.node, [keys[i] for i in operation.positions if i < len(keys)])
    elif isinstance(operation, Replace):
        chosen = [pool[index % len(pool)] for index in operation.prompts]
        keys = list({k: None for keys in chosen for k in keys})
        split = operation.order % (len(keys) + 1)
        tracker.replace(operation.node, keys[split:][::-1] + keys[:split])
    else:
        tracker.drop_node(operation.node)


def linear(tracker: PrefixTracker, keys: list[bytes]) -> dict[str, int]:
    holders = [tracker.holders(key) for key in keys]
    found = {}
    for node in tracker.counts():
        run = next((i for i, held in enumerate(holders) if node not in held), len(keys))
        if run:
            found[node] = run
    return found


@settings(max_examples=400, deadline=None)
@given(
    cap=st.integers(1, 40) | st.just(1000),
    prompts=st.lists(paths, min_size=1, max_size=4),
    history=st.lists(operations, min_size=1, max_size=40),
)
def test_binary_search_equals_a_linear_walk(
    cap: int, prompts: list[tuple[int, ...]], history: list[Store | Remove | Replace | Drop]
) -> None:
    tracker = PrefixTracker(max_chunks_per_node=cap)
    pool = [chain_of(path) for path in prompts]
    for operation in history:
        apply(tracker, operation, pool)
        for keys in pool:
            found = tracker.longest_prefixes(keys)
            assert {node: match.chunks for node, match in found.items()} == linear(tracker, keys)
        assert all(counts.chunks <= cap for counts in tracker.counts().values())
