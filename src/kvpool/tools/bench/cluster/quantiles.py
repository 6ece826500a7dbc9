"""Quantiles of the bench's samples, one rule for every figure."""

from __future__ import annotations

import math
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile by nearest rank (the least value with at least ``q`` of the values
    at or below it), None of nothing."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
