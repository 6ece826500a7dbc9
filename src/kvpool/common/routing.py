"""The routing policy: cache affinity within a load bound.

Given each candidate node's matched prefix (tokens) and load (as the caller
measures it: requests queued and running, say), :meth:`RoutingPolicy.choose`

1. takes the node with the longest match (ties: lower load, then name);
2. ignores affinity when that match is below ``min_match_ratio`` of the
   prompt (or nothing matched): the least loaded node gets the request;
3. ignores affinity when the best node is overloaded, its load above
   ``load_factor`` times the candidates' average plus ``load_slack``: the
   least loaded node gets it (ties: longer match, then name).

Defaults follow SGLang's cache-aware router (``cache_threshold`` 0.3,
``balance_rel_threshold`` 1.5). ``load_slack`` (default 0) is an absolute
margin for small loads: with loads of 1 and 0, a node at 1 is already above
1.5 times the average of 0.5, so set it to a few requests where loads are
request counts.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvpool.common.names import DEFAULT_LOAD_FACTOR, DEFAULT_LOAD_SLACK, DEFAULT_MIN_MATCH_RATIO


class Reason(enum.StrEnum):
    LONGEST_MATCH = "longest_match"
    """The node with the longest cached prefix, within the load bound."""
    OVERLOADED = "overloaded"
    """The longest match was on an overloaded node: least loaded instead."""
    LOW_MATCH = "low_match"
    """No match reached ``min_match_ratio``: least loaded."""


@dataclass(frozen=True, slots=True)
class Decision:
    node: str
    reason: Reason
    matched_tokens: int
    """Cached prefix of the prompt on the chosen node."""


@dataclass(frozen=True)
class RoutingPolicy:
    load_factor: float = DEFAULT_LOAD_FACTOR
    """A node is overloaded above ``load_factor * average load + load_slack``; >= 1."""
    min_match_ratio: float = DEFAULT_MIN_MATCH_RATIO
    """Matched share of the prompt below which cache affinity is ignored; 0..1."""
    load_slack: float = DEFAULT_LOAD_SLACK
    """Absolute load margin added to the bound; >= 0."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.load_factor) and self.load_factor >= 1):
            raise ValueError(f"load_factor must be a number >= 1, got {self.load_factor}")
        if not 0 <= self.min_match_ratio <= 1:
            raise ValueError(f"min_match_ratio must be within 0..1, got {self.min_match_ratio}")
        if not (math.isfinite(self.load_slack) and self.load_slack >= 0):
            raise ValueError(f"load_slack must be a number >= 0, got {self.load_slack}")

    def choose(
        self, matched_tokens: Mapping[str, int], loads: Mapping[str, float], prompt_tokens: int
    ) -> Decision:
        """Pick one of the nodes in ``loads`` (the candidates); ``matched_tokens`` may name
        other nodes too (they are not candidates) and may omit nodes (no match)."""
        if not loads:
            raise ValueError("no candidate nodes: loads is empty")
        if any(not (math.isfinite(load) and load >= 0) for load in loads.values()):
            raise ValueError("loads must be finite numbers >= 0")
        best = min(loads, key=lambda node: (-matched_tokens.get(node, 0), loads[node], node))
        least = min(loads, key=lambda node: (loads[node], -matched_tokens.get(node, 0), node))
        matched = matched_tokens.get(best, 0)
        if matched == 0 or matched < self.min_match_ratio * prompt_tokens:
            return Decision(least, Reason.LOW_MATCH, matched_tokens.get(least, 0))
        average = sum(loads.values()) / len(loads)
        if loads[best] > self.load_factor * average + self.load_slack:
            return Decision(least, Reason.OVERLOADED, matched_tokens.get(least, 0))
        return Decision(best, Reason.LONGEST_MATCH, matched)
