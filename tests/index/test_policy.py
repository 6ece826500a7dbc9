"""The routing policy and the service around it: ranking, the load bound, the match ratio."""

from __future__ import annotations

import pytest

from kvpool.common.routing import Decision, Reason, RoutingPolicy
from kvpool.index.query import Query
from kvpool.index.service import IndexService
from kvpool.index.tracker import PrefixTracker
from tests.support.chunks import chain

DEFAULT = RoutingPolicy()


def test_documented_defaults() -> None:
    assert (DEFAULT.load_factor, DEFAULT.min_match_ratio, DEFAULT.load_slack) == (1.5, 0.3, 0.0)


@pytest.mark.parametrize(
    ("matched", "loads", "expected"),
    [
        # the longest match wins while its node is within the bound
        ({"a": 800, "b": 400}, {"a": 3, "b": 2, "c": 1}, Decision("a", Reason.LONGEST_MATCH, 800)),
        # ties on the match go to the lower load, then the name
        ({"a": 800, "b": 800}, {"a": 2, "b": 1}, Decision("b", Reason.LONGEST_MATCH, 800)),
        ({"a": 800, "b": 800}, {"a": 1, "b": 1}, Decision("a", Reason.LONGEST_MATCH, 800)),
        # a: 4 > 1.5 x average 2: overloaded, the least loaded node instead
        ({"a": 1000}, {"a": 4, "b": 1, "c": 1}, Decision("b", Reason.OVERLOADED, 0)),
        # a: 3 = 1.5 x average 2: exactly at the bound is still fine
        ({"a": 1000}, {"a": 3, "b": 2, "c": 1}, Decision("a", Reason.LONGEST_MATCH, 1000)),
        # among the least loaded, the longer match
        ({"a": 1000, "c": 300}, {"a": 9, "b": 0, "c": 0}, Decision("c", Reason.OVERLOADED, 300)),
        # below 30% of the 1000-token prompt: affinity ignored
        ({"a": 299}, {"a": 1, "b": 0}, Decision("b", Reason.LOW_MATCH, 0)),
        ({"a": 300}, {"a": 1, "b": 0.5}, Decision("a", Reason.LONGEST_MATCH, 300)),
        # nothing matched: least loaded
        ({}, {"a": 2, "b": 1}, Decision("b", Reason.LOW_MATCH, 0)),
        # a node that is not a candidate is never chosen
        ({"x": 1000, "a": 400}, {"a": 1, "b": 1}, Decision("a", Reason.LONGEST_MATCH, 400)),
        # all idle: no one is overloaded
        ({"a": 1000}, {"a": 0, "b": 0}, Decision("a", Reason.LONGEST_MATCH, 1000)),
    ],
)
def test_choose(matched: dict[str, int], loads: dict[str, float], expected: Decision) -> None:
    assert DEFAULT.choose(matched, loads, prompt_tokens=1000) == expected


def test_the_load_factor_and_slack_move_the_bound() -> None:
    loads = {"a": 4.0, "b": 1.0, "c": 1.0}  # average 2
    assert RoutingPolicy(load_factor=2.0).choose({"a": 900}, loads, 1000).node == "a"
    assert RoutingPolicy(load_factor=1.5).choose({"a": 900}, loads, 1000).node == "b"
    assert RoutingPolicy(load_slack=1.0).choose({"a": 900}, loads, 1000).node == "a"
    assert RoutingPolicy(min_match_ratio=0.95).choose({"a": 900}, loads, 1000).reason == (
        Reason.LOW_MATCH
    )


@pytest.mark.parametrize(
    "settings",
    [
        {"load_factor": 0.9},
        {"min_match_ratio": 1.1},
        {"load_slack": -1},
        {"load_factor": float("nan")},
    ],
)
def test_invalid_settings_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(settings))):
        RoutingPolicy(**settings)


@pytest.mark.parametrize("loads", [{}, {"a": -1.0}, {"a": float("inf")}])
def test_invalid_loads_are_refused(loads: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="loads"):
        DEFAULT.choose({}, loads, 100)


class Recorder:
    def __init__(self) -> None:
        self.queries: list[str] = []
        self.decisions: list[Decision] = []

    def observe_query(self, op: str, seconds: float) -> None:
        assert seconds >= 0
        self.queries.append(op)

    def observe_decision(self, decision: Decision) -> None:
        self.decisions.append(decision)


def test_the_service_ranks_nodes_and_routes_among_candidates() -> None:
    tracker = PrefixTracker()
    prompt = chain("prompt", 8)
    tracker.stored("a", prompt[:3])
    tracker.stored("b", prompt)
    tracker.stored("c", prompt[:3])
    tracker.stored("d", prompt[:6])
    recorder = Recorder()
    service = IndexService(tracker, DEFAULT, recorder)
    query = Query.of_keys(prompt, chunk_tokens=16)
    ranking = service.lookup(query)
    assert [(m.node, m.chunks, m.tokens) for m in ranking] == [
        ("b", 8, 128),
        ("d", 6, 96),
        ("a", 3, 48),
        ("c", 3, 48),
    ]
    assert [m.node for m in service.lookup(query, nodes=["c", "a"])] == ["a", "c"]
    route = service.route(query, {"a": 1, "c": 1, "d": 1})  # b is not a candidate
    assert route.decision == Decision("d", Reason.LONGEST_MATCH, 96)
    assert [m.node for m in route.matches] == ["d", "a", "c"]
    overloaded = service.route(query, {"d": 5, "a": 0, "c": 1})
    assert overloaded.decision == Decision("a", Reason.OVERLOADED, 48)
    assert recorder.queries == ["lookup", "lookup", "route", "route"]
    assert recorder.decisions == [route.decision, overloaded.decision]
