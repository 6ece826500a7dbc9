"""Eviction policies behind a plain registry: a literal name maps to "module:Class".

The registry is :data:`kvpool_agent.names.EVICTION_POLICIES`, so the configuration
checks a name without loading any policy. Modules are imported on first use; an
unknown name is an error that lists the known ones.
"""

from __future__ import annotations

import importlib

from kvpool_agent.core.policies.base import EvictionPolicy, PolicyFactory
from kvpool_agent.core.policies.slotlists import SlotArena
from kvpool_agent.names import EVICTION_POLICIES, POLICY_NAMES


def policy_factory(name: str) -> PolicyFactory:
    """The policy class registered under ``name``."""
    try:
        target = EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known policies are {', '.join(POLICY_NAMES)}"
        ) from None
    module_name, class_name = target.split(":")
    factory: PolicyFactory = getattr(importlib.import_module(module_name), class_name)
    return factory


__all__ = ["POLICY_NAMES", "EvictionPolicy", "PolicyFactory", "SlotArena", "policy_factory"]
