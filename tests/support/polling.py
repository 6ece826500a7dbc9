"""Waiting, bounded, for something another process does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(check: Callable[[], T], timeout: float = 15.0, what: str = "") -> T:
    """``check()``'s result once it stops raising AssertionError (or its last error)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError as error:
            if time.monotonic() > deadline:
                if not what:
                    raise
                raise AssertionError(f"{what}: not within {timeout:.0f} s: {error}") from error
        time.sleep(0.05)


def wait_until(condition: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Return once ``condition()`` is true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        time.sleep(0.01)
