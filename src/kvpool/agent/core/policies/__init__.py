"""Eviction policies behind a plain registry: a literal name maps to its class.

The names are :data:`kvpool.common.names.POLICY_NAMES`, so the configuration checks a name
without loading any policy; :data:`POLICIES` maps each name to its class, imported here
(each policy is a few dozen lines of pure Python). An unknown name is an error that lists
the known ones.
"""

from __future__ import annotations

from kvpool.agent.core.policies.arc import ARCPolicy
from kvpool.agent.core.policies.base import EvictionPolicy, PolicyFactory
from kvpool.agent.core.policies.lru import LRUPolicy
from kvpool.agent.core.policies.slotlists import SlotArena
from kvpool.common.names import POLICY_NAMES

POLICIES: dict[str, PolicyFactory] = {"lru": LRUPolicy, "arc": ARCPolicy}
"""Every policy by its name: the names of :data:`~kvpool.common.names.POLICY_NAMES`."""


def policy_factory(name: str) -> PolicyFactory:
    """The policy class registered under ``name``."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known policies are {', '.join(POLICY_NAMES)}"
        ) from None


__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "EvictionPolicy",
    "PolicyFactory",
    "SlotArena",
    "policy_factory",
]
