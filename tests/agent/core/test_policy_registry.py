"""The eviction policies' registry holds a class for every name a configuration may give."""

from __future__ import annotations

import pytest

from kvpool.agent.core.policies import POLICIES, policy_factory
from kvpool.common.names import POLICY_NAMES


def test_every_name_has_its_class() -> None:
    assert tuple(POLICIES) == POLICY_NAMES


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_the_factory_gives_the_registered_class(name: str) -> None:
    assert policy_factory(name) is POLICIES[name]


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known policies are lru, arc"):
        policy_factory("fifo")
