"""One log line for a flood of the same event instead of one per occurrence."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Seen:
    logged_at: float
    suppressed: int = 0


class RateLimitedLog:
    """Logs each distinct event at most once per ``interval_seconds``, with what it skipped.

    The first occurrence is logged at once; later ones within the interval are only
    counted, and the next line logged says how many there were.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval_seconds
        self._clock = clock
        self._seen: dict[str, _Seen] = {}

    def warning(self, event: str) -> None:
        now = self._clock()
        seen = self._seen.get(event)
        if seen is not None and now - seen.logged_at < self._interval:
            seen.suppressed += 1
            return
        if seen is None or not seen.suppressed:
            self._logger.warning("%s", event)
        else:
            self._logger.warning(
                "%s (and %d more times since the last such line)", event, seen.suppressed
            )
        self._seen[event] = _Seen(now)
