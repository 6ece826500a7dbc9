"""What a check found: PASS, WARN, FAIL or SKIP, what was seen, and on WARN or FAIL the fix;
one line each. WARN: it works, but not as well as it could (exit status 0)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Outcome(enum.StrEnum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class Check:
    name: str
    outcome: Outcome
    seen: str
    """What the check saw; for a SKIP, why it did not run."""
    fix: str | None = None
    """The remedy, on WARN and FAIL."""

    def lines(self) -> list[str]:
        head = f"{self.outcome:<4}  {self.name:<{NAME_WIDTH}}  {self.seen}"
        if self.fix is None:
            return [head]
        return [head, f"{'':<4}  {'':<{NAME_WIDTH}}  fix: {self.fix}"]


NAME_WIDTH = 11


def passed(name: str, seen: str) -> Check:
    return Check(name, Outcome.PASS, seen)


def failed(name: str, seen: str, fix: str) -> Check:
    return Check(name, Outcome.FAIL, seen, fix)


def warned(name: str, seen: str, fix: str) -> Check:
    return Check(name, Outcome.WARN, seen, fix)


def skipped(name: str, reason: str) -> Check:
    return Check(name, Outcome.SKIP, reason)


def skipped_all(names: Iterable[str], reason: str) -> list[Check]:
    return [skipped(name, reason) for name in names]


def exit_code(checks: Iterable[Check]) -> int:
    """0 when nothing failed, else 1."""
    return int(any(check.outcome is Outcome.FAIL for check in checks))


def size(count: int) -> str:
    """Bytes for people: ``64.0 MiB``."""
    if count < 1024:
        return f"{count} B"
    value = count / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
