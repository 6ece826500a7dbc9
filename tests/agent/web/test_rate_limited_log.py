from __future__ import annotations

import logging

import pytest

from kvpool_agent.web.rate_limited_log import RateLimitedLog
from tests.support.l1 import FakeClock


def test_a_flood_is_one_line_a_minute_with_its_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    flood = RateLimitedLog(logging.getLogger("flood"), interval_seconds=60, clock=clock)
    with caplog.at_level(logging.WARNING, logger="flood"):
        for _ in range(1000):
            flood.warning("too many connections")
            flood.warning("header timeout")
            clock.advance(0.01)
        assert [r.getMessage() for r in caplog.records] == [
            "too many connections",
            "header timeout",
        ]
        clock.advance(60)
        flood.warning("too many connections")
    assert caplog.records[-1].getMessage() == (
        "too many connections (and 999 more times since the last such line)"
    )
