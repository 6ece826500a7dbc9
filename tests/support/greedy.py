"""Compare two engines' greedy generations up to numerical noise, and no further.

Two engines that compute the same logits pick the same tokens. They do not compute
bit-identical logits whenever their kernels differ (AVX2, AVX-512, AMX), the batch around a
request differs (a preempted request recomputed beside others), or a prefill runs over
loaded KV instead of from scratch. Such a difference changes a greedy token only where the
two best candidates are nearly tied, and every token after that follows another context.

So, position by position, while the two generations agree, the chosen token's
log-probability must agree within ``TOLERANCE``: the same context gives the same
distribution. Where they first differ, it must be a near tie in both engines: each one's
token must be within ``TOLERANCE`` of the other's choice in its own distribution. Past
that point the contexts differ and nothing more is compared.

Wrong KV moves log-probabilities by far more than ``TOLERANCE`` (see
``test_poisoned_cache_changes_the_output``), so this comparison can fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TOLERANCE = 0.25
"""Nats. bf16 logits of this model are a few units large and carry about 0.02 of rounding;
the measured gap between kernels and batch compositions is reported by :func:`compare`."""

Candidates = Sequence[Sequence[float]]
"""One generated position: (token, log-probability) pairs, best first."""


@dataclass(frozen=True)
class Comparison:
    """How one generation compares with its reference."""

    agreed: int
    """Leading positions with the same token."""
    largest_gap: float
    """Largest difference of the chosen token's log-probability over the agreed positions."""
    problem: str | None
    """Why the two are not the same up to noise; None if they are."""


def _logprob(candidates: Candidates, token: int) -> float | None:
    for candidate, logprob in candidates:
        if int(candidate) == token:
            return float(logprob)
    return None


def compare(
    tokens: Sequence[int],
    top: Sequence[Candidates],
    ref_tokens: Sequence[int],
    ref_top: Sequence[Candidates],
    tolerance: float = TOLERANCE,
) -> Comparison:
    """Compare one generation (tokens and each position's candidates) with a reference."""
    if len(tokens) != len(ref_tokens):
        return Comparison(0, 0.0, f"{len(tokens)} tokens, the reference has {len(ref_tokens)}")
    largest = 0.0
    for position, (token, ref_token) in enumerate(zip(tokens, ref_tokens, strict=True)):
        ours, theirs = _logprob(top[position], token), _logprob(ref_top[position], ref_token)
        if token == ref_token:
            assert ours is not None and theirs is not None, "the chosen token has no logprob"
            largest = max(largest, abs(ours - theirs))
            if abs(ours - theirs) > tolerance:
                return Comparison(
                    position,
                    largest,
                    f"token {position} ({token}): log-probability {ours:.4f} vs {theirs:.4f}",
                )
            continue
        # The first difference: a near tie in both distributions, or a real one.
        ours_of_theirs = _logprob(top[position], ref_token)
        theirs_of_ours = _logprob(ref_top[position], token)
        tie = (
            ours is not None
            and theirs is not None
            and ours_of_theirs is not None
            and theirs_of_ours is not None
            and ours - ours_of_theirs <= tolerance
            and theirs - theirs_of_ours <= tolerance
        )
        problem = None
        if not tie:
            problem = (
                f"token {position}: {token} vs {ref_token} is no near tie "
                f"(ours {top[position]}, reference {ref_top[position]})"
            )
        return Comparison(position, largest, problem)
    return Comparison(len(tokens), largest, None)


def problems(
    tokens: Sequence[Sequence[int]],
    top: Sequence[Sequence[Candidates]],
    ref_tokens: Sequence[Sequence[int]],
    ref_top: Sequence[Sequence[Candidates]],
    tolerance: float = TOLERANCE,
) -> list[str]:
    """Every request whose generation is not its reference's up to noise, with the reason."""
    if len(tokens) != len(ref_tokens):
        return [f"{len(tokens)} generations, the reference has {len(ref_tokens)}"]
    found = []
    for index in range(len(tokens)):
        result = compare(tokens[index], top[index], ref_tokens[index], ref_top[index], tolerance)
        if result.problem is not None:
            found.append(f"request {index}: {result.problem}")
    return found
