"""A circuit breaker: a dead backend costs callers an immediate refusal, not a timeout each.

::

    CLOSED ──failures in a row──► OPEN ──reset_seconds──► HALF_OPEN (lets one trial call through)
      ▲                             ▲                          │
      └──── the trial succeeds ─────┼──── the trial fails ─────┘

A trial that never reports (its caller was cancelled) is presumed lost after
``reset_seconds``, and the next caller becomes the trial. Not thread-safe: the
adapters call it from their event loop only.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CircuitBreaker:
    def __init__(
        self,
        failures: int,
        reset_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures = failures
        self.reset_seconds = reset_seconds
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.opened = 0
        """Times the breaker opened."""
        self.refused = 0
        """Calls refused while open (or while a half-open trial was out)."""
        self._in_a_row = 0
        self._since = 0.0  # when it opened, or when the trial started

    def allow(self) -> bool:
        """Whether a call may go to the backend now; it must report success() or failure()."""
        if self.state is BreakerState.CLOSED:
            return True
        if self._clock() - self._since >= self.reset_seconds:
            self.state = BreakerState.HALF_OPEN
            self._since = self._clock()
            return True
        self.refused += 1
        return False

    def success(self) -> None:
        self.state = BreakerState.CLOSED
        self._in_a_row = 0

    def failure(self) -> bool:
        """Count a failed call; True if this one opened the breaker."""
        self._in_a_row += 1
        if self.state is BreakerState.OPEN:
            return False
        if self.state is BreakerState.HALF_OPEN or self._in_a_row >= self.failures:
            self.state = BreakerState.OPEN
            self._since = self._clock()
            self.opened += 1
            return True
        return False
