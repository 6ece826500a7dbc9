"""The pool's status as a function of the operator's outcome and the DaemonSet's rollout."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvpool.operator.render import PICKER_PORT_NAME, Pool, render
from kvpool.operator.spec import PoolSpec
from kvpool.operator.status import IndexReplicas, Problem, Rollout, pool_status, written

POOL = Pool("gpu", "inference", "0d3c5e9a-1f2b-4c6d-8e9f-0a1b2c3d4e5f")

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def _status(
    rollout: Rollout | None,
    *,
    generation: int = 2,
    observed: int | None = 2,
    problem: Problem | None = None,
    previous: dict[str, Any] | None = None,
    now: datetime = T0,
    index: IndexReplicas | None = None,
) -> dict[str, Any]:
    return pool_status(
        generation=generation,
        observed_generation=observed,
        problem=problem,
        rollout=rollout,
        previous=previous or {},
        now=now,
        index=index,
    )


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        (
            Rollout(desired=3, updated=3, ready=3, observed=True),
            {
                "Ready": ("True", "AgentsReady"),
                "Progressing": ("False", "RolloutComplete"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            Rollout(desired=3, updated=1, ready=3, observed=True),
            {
                "Ready": ("False", "RollingOut"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            Rollout(desired=3, updated=3, ready=3, observed=False),
            {
                "Ready": ("False", "RollingOut"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            Rollout(desired=3, updated=3, ready=2, observed=True),
            {
                "Ready": ("False", "AgentsNotReady"),
                "Progressing": ("False", "RolloutComplete"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            Rollout(desired=0, updated=0, ready=0, observed=True),
            {
                "Ready": ("False", "NoNodes"),
                "Progressing": ("False", "RolloutComplete"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            None,
            {
                "Ready": ("False", "Pending"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
    ],
)
def test_conditions_follow_the_rollout(
    rollout: Rollout | None, expected: dict[str, tuple[str, str]]
) -> None:
    status = _status(rollout)
    assert _conditions(status) == expected
    assert status["observedGeneration"] == 2
    assert (status["desiredNodes"], status["readyNodes"], status["updatedNodes"]) == (
        (rollout.desired, rollout.ready, rollout.updated) if rollout else (0, 0, 0)
    )


def test_messages_count_the_agents() -> None:
    status = _status(Rollout(desired=3, updated=3, ready=2, observed=True))
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "2 of 3 agents ready"
    assert ready["observedGeneration"] == 2


def test_a_generation_not_yet_applied_is_reconciling() -> None:
    status = _status(Rollout(3, 3, 3, True), generation=3, observed=2)
    assert _conditions(status)["Ready"] == ("False", "Reconciling")
    assert _conditions(status)["Progressing"] == ("True", "Reconciling")
    assert status["observedGeneration"] == 2


@pytest.mark.parametrize("reason", ["InvalidSpec", "ApplyFailed"])
def test_a_problem_degrades_the_pool(reason: str) -> None:
    problem = Problem(reason, "spec.l1.size: too small")
    status = _status(Rollout(3, 3, 3, True), problem=problem)
    assert _conditions(status) == {
        "Ready": ("False", reason),
        "Progressing": ("False", reason),
        "Degraded": ("True", reason),
    }
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == "spec.l1.size: too small"
    assert Problem.recorded(status) == problem  # kept by status updates from the DaemonSet
    assert Problem.recorded(_status(Rollout(3, 3, 3, True))) is None


def test_an_unknown_observed_generation_is_left_out() -> None:
    assert "observedGeneration" not in _status(None, observed=None)


def test_transition_times_change_only_with_the_status() -> None:
    first = _status(Rollout(3, 3, 2, True), now=T0)
    later = T0 + timedelta(minutes=5)
    same = _status(Rollout(3, 3, 1, True), previous=first, now=later)
    flipped = _status(Rollout(3, 3, 3, True), previous=first, now=later)
    times = {c["type"]: c["lastTransitionTime"] for c in same["conditions"]}
    assert set(times.values()) == {"2026-01-01T00:00:00Z"}
    flipped_times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert flipped_times["Ready"] == "2026-01-01T00:05:00Z"
    assert flipped_times["Degraded"] == "2026-01-01T00:00:00Z"


def test_rollout_of_a_daemonset() -> None:
    daemonset: dict[str, Any] = {"metadata": {"generation": 4}}
    assert Rollout.of(daemonset) is None  # its controller has not reported yet
    daemonset["status"] = {
        "observedGeneration": 3,
        "desiredNumberScheduled": 5,
        "updatedNumberScheduled": 2,
        "numberReady": 4,
    }
    assert Rollout.of(daemonset) == Rollout(desired=5, updated=2, ready=4, observed=False)
    daemonset["status"]["observedGeneration"] = 4
    rollout = Rollout.of(daemonset)
    assert rollout is not None and rollout.observed and not rollout.rolled_out


def test_the_index_is_reported_beside_the_agents() -> None:
    agents_ready = Rollout(3, 3, 3, True)
    status = _status(agents_ready, index=IndexReplicas(replicas=2, ready=0))
    assert status["index"] == {"replicas": 2, "readyReplicas": 0, "pickerPort": None}
    # the conditions are about the agents: an index that is not ready leaves the pool Ready
    assert _conditions(status)["Ready"] == ("True", "AgentsReady")
    # without an index, a merge patch removes status.index
    assert _status(agents_ready)["index"] is None


def test_index_replicas_of_a_deployment() -> None:
    deployment: dict[str, Any] = {"metadata": {"generation": 1}, "spec": {"replicas": 2}}
    of = IndexReplicas.of(deployment, PICKER_PORT_NAME)
    assert of == IndexReplicas(replicas=2, ready=0)  # no status yet
    deployment["status"] = {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}
    assert IndexReplicas.of(deployment, PICKER_PORT_NAME) == IndexReplicas(replicas=2, ready=1)


def test_the_picker_port_is_reported_from_the_rendered_deployment() -> None:
    """status.index.pickerPort is the port the index pods serve the picker on (what an
    InferencePool's endpointPickerRef names), absent when they serve none."""
    tokens = {"tenants": {"tokensSecretRef": {"name": "t"}}}
    picker = {"enabled": True, "port": 9002, "selector": {"app": "vllm"}}
    fingerprint = {"model": "m", "dtype": "bfloat16", "kvLayout": "nhd"}
    serving = {"enabled": True, "fingerprint": fingerprint, "picker": picker}
    for index, port in (({"enabled": True}, None), (serving, 9002)):
        children = render(POOL, PoolSpec.parse({**tokens, "index": index}), default_image="i")
        assert children.index is not None
        replicas = IndexReplicas.of(children.index.deployment, PICKER_PORT_NAME)
        assert replicas.picker_port == port
        assert replicas.status() == {"replicas": 1, "readyReplicas": 0, "pickerPort": port}


@pytest.mark.parametrize(
    ("status", "previous", "same"),
    [
        ({"index": None}, {}, True),
        ({"index": None}, {"index": {"replicas": 1}}, False),
        ({"index": {"replicas": 1, "pickerPort": None}}, {"index": {"replicas": 1}}, True),
        (
            {"index": {"replicas": 1, "pickerPort": None}},
            {"index": {"replicas": 1, "pickerPort": 7405}},
            False,  # the picker was turned off: the null removes the port
        ),
        ({"index": {"replicas": 1}}, {"index": {"replicas": 1, "pickerPort": 7405}}, False),
        ({"readyNodes": 2}, {"readyNodes": 2, "sharedSpaces": []}, True),  # others' fields
    ],
)
def test_a_status_is_written_only_when_it_says_something_new(
    status: dict[str, Any], previous: dict[str, Any], same: bool
) -> None:
    assert written(status, previous) is same


def test_conditions_of_other_types_are_kept_as_they_are() -> None:
    """The SharedSpaces condition is kvpool.operator.spaces' to write, not the pool's."""
    spaces = {
        "type": "SharedSpaces",
        "status": "False",
        "reason": "PinsIncomplete",
        "message": "pinning p of the space docs failed on 1 agents: 10.0.0.1:7401: unreachable",
        "observedGeneration": 1,
        "lastTransitionTime": "2025-12-31T00:00:00Z",
    }
    ready = Rollout(desired=1, updated=1, ready=1, observed=True)
    first = _status(ready, previous={"conditions": [spaces]})
    assert [c["type"] for c in first["conditions"]] == [
        "Ready",
        "Progressing",
        "Degraded",
        "SharedSpaces",
    ]
    assert first["conditions"][3] == spaces
    assert _status(ready, previous=first, now=T0 + timedelta(minutes=1)) == first
