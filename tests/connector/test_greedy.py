"""The comparison of greedy generations up to numerical noise (no engine needed)."""

from __future__ import annotations

from tests.support.greedy import TOLERANCE, compare

STEP = 0.03125  # one bf16 rounding step of a logit between 4 and 8


def position(*candidates: tuple[int, float]) -> list[list[float]]:
    return [[token, logprob] for token, logprob in candidates]


REF_TOP = [
    position((5, -1.0), (6, -2.0)),
    position((7, -0.50), (8, -0.52)),  # a near tie
    position((9, -0.1), (10, -3.0)),
]
REF = [5, 7, 9]


def test_identical_generations_agree() -> None:
    result = compare(REF, REF_TOP, REF, REF_TOP)
    assert result.problem is None
    assert result.agreed == 3 and result.largest_gap == 0.0


def test_a_rounding_step_is_noise() -> None:
    top = [position((5, -1.0 + STEP), (6, -2.0)), *REF_TOP[1:]]
    result = compare(REF, top, REF, REF_TOP)
    assert result.problem is None and result.largest_gap == STEP


def test_a_near_tie_may_flip_and_ends_the_comparison() -> None:
    top = [REF_TOP[0], position((8, -0.50), (7, -0.51)), position((11, -0.2), (9, -5.0))]
    result = compare([5, 8, 11], top, REF, REF_TOP)
    assert result.problem is None
    assert result.agreed == 1  # the rest follows another context


def test_a_shifted_distribution_is_not_noise() -> None:
    top = [position((5, -1.0 - 2 * TOLERANCE), (6, -2.0)), *REF_TOP[1:]]
    problem = compare(REF, top, REF, REF_TOP).problem
    assert problem is not None and "log-probability" in problem


def test_a_flip_that_is_no_near_tie_is_a_difference() -> None:
    top = [position((6, -0.5), (5, -1.9)), *REF_TOP[1:]]  # the reference prefers 5 by 1 nat
    problem = compare([6, 7, 9], top, REF, REF_TOP).problem
    assert problem is not None and "no near tie" in problem


def test_a_token_outside_the_candidates_is_a_difference() -> None:
    top = [position((12, -0.1), (13, -0.2)), *REF_TOP[1:]]
    assert compare([12, 7, 9], top, REF, REF_TOP).problem is not None


def test_lengths_must_match() -> None:
    assert compare(REF[:2], REF_TOP[:2], REF, REF_TOP).problem is not None
