"""What a pool's status says of its shared spaces: ``status.sharedSpaces`` and the
``SharedSpaces`` condition (pure).

The condition holds (``SpacesPublished``) when every space is in the pool's ConfigMaps and
every pinned prefix is pinned (and warm) on every agent; otherwise it says why not, one
problem after another on one line: ``PinsNeedFingerprint``, ``PinsIncomplete`` (agents that
failed, a prefix shorter than a chunk), ``ClearIncomplete`` (a removed space whose chunks
some agents did not clear: retried on the next pass). A pool without spaces has neither.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from kvpool.operator.reasons import SHARED_SPACES, SPACES_PUBLISHED
from kvpool.operator.status import Assessment, Problem, condition


def spaces_status(
    previous: Mapping[str, Any],
    generation: int,
    spaces: Sequence[Mapping[str, Any]],
    problems: Sequence[Problem],
    now: datetime,
) -> dict[str, Any]:
    """The keys of a pool's ``status`` about its spaces (None removes one, in a merge patch),
    from ``previous`` (the status as it is) and the pass's ``spaces`` and ``problems``."""
    conditions = list(previous.get("conditions") or ())
    earlier = next((c for c in conditions if c.get("type") == SHARED_SPACES), None)
    others = [c for c in conditions if c.get("type") != SHARED_SPACES]
    status: dict[str, Any] = {"sharedSpaces": list(spaces) or None}
    if spaces or problems:
        value: Assessment = (
            (False, problems[0].reason, "; ".join(problem.message for problem in problems))
            if problems
            else (
                True,
                SPACES_PUBLISHED,
                f"{len(spaces)} shared spaces are published and their pinned prefixes are "
                "on every agent",
            )
        )
        status["conditions"] = [*others, condition(SHARED_SPACES, value, generation, earlier, now)]
    elif earlier is not None:
        status["conditions"] = others
    return status
