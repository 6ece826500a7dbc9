from __future__ import annotations

import logging

import pytest

from kvpool.common.web.rate_limited_log import RateLimitedLog
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


def test_a_flood_of_failures_is_one_traceback_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    flood = RateLimitedLog(logging.getLogger("failures"), interval_seconds=60, clock=clock)
    with caplog.at_level(logging.ERROR, logger="failures"):
        for _ in range(1000):
            try:
                raise RecursionError("deep")
            except RecursionError:
                flood.exception("internal error serving lookup")
            clock.advance(0.01)
        clock.advance(60)
        try:
            raise KeyError("x")
        except KeyError:
            flood.exception("internal error serving lookup")
    assert [r.getMessage() for r in caplog.records] == [
        "internal error serving lookup",
        "internal error serving lookup (and 999 more times since the last such line)",
    ]
    assert all(r.exc_info is not None for r in caplog.records)
    assert caplog.records[0].exc_info[0] is RecursionError  # type: ignore[index]
