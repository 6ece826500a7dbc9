"""The pool's status: a pure function of what the operator did and what the DaemonSet (and
the index's Deployment) report.

Conditions (each with a CamelCase reason and a message for people):

- ``Ready``: every selected node runs an agent of the current spec and it is ready
  (``AgentsReady``); otherwise why not: ``InvalidSpec``, ``ApplyFailed``, ``Reconciling``
  (the operator has not applied this generation yet), ``Pending`` (no DaemonSet status
  yet), ``NoNodes``, ``RollingOut``, ``AgentsNotReady``.
- ``Progressing``: a rollout is under way (``Reconciling``, ``RollingOut``) or not
  (``RolloutComplete``, or the problem that stops it).
- ``Degraded``: the operator cannot make the children from the spec: ``InvalidSpec``
  (fix the pool) or ``ApplyFailed`` (the API server refused; retried). ``AsExpected``
  otherwise. A problem stays recorded here until the next apply succeeds, so status
  updates driven by the DaemonSet keep it.

A condition's ``lastTransitionTime`` changes only when its status does. Conditions of other
types (``SharedSpaces``, which ``kvpool.operator.spaces`` writes) are kept as they are.

``index``: the prefix index's replicas (``replicas`` asked for, ``readyReplicas``) and the
endpoint picker's port (``pickerPort``, where its pods serve one) while the pool has an
index Deployment; absent otherwise. The conditions are about the agents only:
the cache works without the index (gateways that cannot reach it route without affinity),
so an index that is not ready does not make the pool unready.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvpool.operator.reasons import (
    AGENTS_NOT_READY,
    AGENTS_READY,
    APPLY_FAILED,
    AS_EXPECTED,
    DEGRADED,
    INVALID_SPEC,
    NO_NODES,
    PENDING,
    PROGRESSING,
    READY,
    RECONCILING,
    ROLLING_OUT,
    ROLLOUT_COMPLETE,
)

PROBLEM_REASONS = (INVALID_SPEC, APPLY_FAILED)

Assessment = tuple[bool, str, str]
"""A condition as (holds, reason, message)."""


@dataclass(frozen=True)
class Problem:
    """Why the children could not be made from the spec."""

    reason: str
    message: str

    @classmethod
    def recorded(cls, status: Mapping[str, Any]) -> Problem | None:
        """The problem a previous status recorded in its Degraded condition, if any."""
        for condition in status.get("conditions", ()):
            if (
                condition.get("type") == DEGRADED
                and condition.get("status") == "True"
                and condition.get("reason") in PROBLEM_REASONS
            ):
                return cls(condition["reason"], condition.get("message", ""))
        return None


@dataclass(frozen=True)
class Rollout:
    """What the DaemonSet controller reports about the agents."""

    desired: int
    updated: int
    ready: int
    observed: bool
    """Whether the controller has seen the DaemonSet's current spec."""

    @classmethod
    def of(cls, daemonset: Mapping[str, Any]) -> Rollout | None:
        """The DaemonSet's rollout; None until its controller has written a status."""
        status = daemonset.get("status") or {}
        if "observedGeneration" not in status:
            return None
        return cls(
            desired=int(status.get("desiredNumberScheduled", 0)),
            updated=int(status.get("updatedNumberScheduled", 0)),
            ready=int(status.get("numberReady", 0)),
            observed=int(status["observedGeneration"])
            >= int(daemonset.get("metadata", {}).get("generation", 0)),
        )

    @property
    def rolled_out(self) -> bool:
        return self.observed and self.updated >= self.desired


@dataclass(frozen=True)
class IndexReplicas:
    """What the index's Deployment asks for and what its controller reports ready."""

    replicas: int
    ready: int
    picker_port: int | None = None
    """The endpoint picker's port (the container port ``grpc-picker``), if it serves one."""

    @classmethod
    def of(cls, deployment: Mapping[str, Any], picker_port_name: str) -> IndexReplicas:
        """From the Deployment: its replicas, and the picker's container port (by its
        name) that its pods serve, as rendered."""
        spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
        containers = (spec.get("template") or {}).get("spec", {}).get("containers") or ()
        picker = [
            int(port["containerPort"])
            for container in containers
            for port in container.get("ports") or ()
            if port.get("name") == picker_port_name
        ]
        return cls(
            int(spec.get("replicas", 1)),
            int(status.get("readyReplicas", 0)),
            picker[0] if picker else None,
        )

    def status(self) -> dict[str, int | None]:
        """``status.index``; ``pickerPort`` None (no picker) as null, which a merge patch
        of the status removes."""
        return {
            "replicas": self.replicas,
            "readyReplicas": self.ready,
            "pickerPort": self.picker_port,
        }


def written(status: Mapping[str, Any], previous: Mapping[str, Any]) -> bool:
    """Whether ``previous`` already says what the merge patch ``status`` would: a null says
    "absent" (at any depth), as the patch makes it."""
    return all(_same(value, previous.get(key)) for key, value in status.items())


def _same(patch: Any, current: Any) -> bool:
    if patch is None:
        return current is None
    if isinstance(patch, Mapping):
        return (
            isinstance(current, Mapping)
            and written(patch, current)
            and all(key in patch for key in current)
        )
    return bool(patch == current)


def pool_status(
    *,
    generation: int,
    observed_generation: int | None,
    problem: Problem | None,
    rollout: Rollout | None,
    previous: Mapping[str, Any],
    now: datetime,
    index: IndexReplicas | None = None,
) -> dict[str, Any]:
    """The whole ``status`` of a pool; ``index`` None (no index) as ``"index": None``, which
    a merge patch of the status removes."""
    ready, progressing = _assess(generation, observed_generation, problem, rollout)
    degraded: Assessment = (
        (True, problem.reason, problem.message)
        if problem
        else (False, AS_EXPECTED, "nothing stops the operator from making the children")
    )
    earlier = {c.get("type"): c for c in previous.get("conditions", ())}
    own = (READY, PROGRESSING, DEGRADED)
    status: dict[str, Any] = {
        "desiredNodes": rollout.desired if rollout else 0,
        "readyNodes": rollout.ready if rollout else 0,
        "updatedNodes": rollout.updated if rollout else 0,
        "conditions": [
            condition(kind, value, generation, earlier.get(kind), now)
            for kind, value in zip(own, (ready, progressing, degraded), strict=True)
        ]
        + [c for c in previous.get("conditions", ()) if c.get("type") not in own],
        "index": index.status() if index else None,
    }
    if observed_generation is not None:
        status["observedGeneration"] = observed_generation
    return status


def _assess(
    generation: int,
    observed_generation: int | None,
    problem: Problem | None,
    rollout: Rollout | None,
) -> tuple[Assessment, Assessment]:
    """(Ready, Progressing) as (status, reason, message)."""
    if problem is not None:
        halted = f"stopped: {problem.message}"
        return (False, problem.reason, halted), (False, problem.reason, halted)
    if observed_generation != generation:
        waiting = f"the operator has not applied generation {generation} yet"
        return (False, RECONCILING, waiting), (True, RECONCILING, waiting)
    if rollout is None:
        waiting = "waiting for the DaemonSet controller to report the agents"
        return (False, PENDING, waiting), (True, ROLLING_OUT, waiting)
    counts = f"{rollout.ready} of {rollout.desired} agents ready"
    if not rollout.rolled_out:
        moving = f"{rollout.updated} of {rollout.desired} agents run the current configuration"
        return (False, ROLLING_OUT, moving), (True, ROLLING_OUT, moving)
    done = (False, ROLLOUT_COMPLETE, f"every agent runs generation {generation}")
    if rollout.desired == 0:
        return (False, NO_NODES, "no node matches the pool's node selector and tolerations"), done
    if rollout.ready < rollout.desired:
        return (False, AGENTS_NOT_READY, counts), done
    return (True, AGENTS_READY, counts), done


def condition(
    kind: str,
    value: Assessment,
    generation: int,
    earlier: Mapping[str, Any] | None,
    now: datetime,
) -> dict[str, Any]:
    status = "True" if value[0] else "False"
    unchanged = earlier is not None and earlier.get("status") == status
    return {
        "type": kind,
        "status": status,
        "reason": value[1],
        "message": value[2],
        "observedGeneration": generation,
        "lastTransitionTime": (
            earlier["lastTransitionTime"]
            if unchanged and earlier is not None and "lastTransitionTime" in earlier
            else now.strftime("%Y-%m-%dT%H:%M:%SZ")
        ),
    }
