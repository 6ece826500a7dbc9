"""Fixtures of the agent's tests: a clock the tests move."""

from __future__ import annotations

import pytest

from tests.support.l1 import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
