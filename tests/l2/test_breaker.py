"""The circuit breaker's state machine, on a fake clock."""

from __future__ import annotations

from kvpool.agent.l2.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _opened(clock: Clock) -> CircuitBreaker:
    breaker = CircuitBreaker(failures=3, reset_seconds=10.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        assert not breaker.failure()
    assert breaker.allow()
    assert breaker.failure()  # the third in a row opens it
    return breaker


def test_consecutive_failures_open_it_and_a_success_resets_the_count() -> None:
    breaker = CircuitBreaker(failures=3, reset_seconds=10.0, clock=Clock())
    for _ in range(5):
        breaker.failure()
        breaker.failure()
        breaker.success()
    assert breaker.state is BreakerState.CLOSED and breaker.opened == 0
    assert _opened(Clock()).state is BreakerState.OPEN


def test_open_refuses_until_the_reset_time_then_lets_one_trial_through() -> None:
    clock = Clock()
    breaker = _opened(clock)
    clock.now += 9.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.allow()
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # one trial at a time
    assert breaker.refused == 2
    breaker.success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow() and breaker.allow()


def test_a_failed_trial_opens_it_again_for_a_full_period() -> None:
    clock = Clock()
    breaker = _opened(clock)
    clock.now += 10
    assert breaker.allow()
    assert breaker.failure()
    assert breaker.state is BreakerState.OPEN and breaker.opened == 2
    clock.now += 9.9
    assert not breaker.allow()


def test_a_lost_trial_is_replaced_after_the_reset_time() -> None:
    clock = Clock()
    breaker = _opened(clock)
    clock.now += 10
    assert breaker.allow()  # this trial never reports (its caller was cancelled)
    clock.now += 9.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.allow()


def test_late_failures_of_calls_let_through_before_do_not_extend_the_open_period() -> None:
    clock = Clock()
    breaker = _opened(clock)
    clock.now += 5
    assert not breaker.failure()
    clock.now += 5
    assert breaker.allow()
