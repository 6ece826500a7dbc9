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

    def info(self, event: str) -> None:
        self._log(logging.INFO, event)

    def warning(self, event: str) -> None:
        self._log(logging.WARNING, event)

    def exception(self, event: str) -> None:
        """``event`` at ERROR with the traceback of the exception being handled; a flood of
        them (a request that fails the same way again and again) is one traceback a minute."""
        self._log(logging.ERROR, event, exc_info=True)

    def _log(self, level: int, event: str, *, exc_info: bool = False) -> None:
        now = self._clock()
        seen = self._seen.get(event)
        if seen is not None and now - seen.logged_at < self._interval:
            seen.suppressed += 1
            return
        if seen is None or not seen.suppressed:
            self._logger.log(level, "%s", event, exc_info=exc_info)
        else:
            self._logger.log(
                level,
                "%s (and %d more times since the last such line)",
                event,
                seen.suppressed,
                exc_info=exc_info,
            )
        self._seen[event] = _Seen(now)
