"""Eviction policies behind a plain registry: a literal name maps to "module:Class".

Modules are imported on first use; an unknown name is an error that lists the
known ones. Adding a policy is one line here and one module beside this file.
"""

from __future__ import annotations

import importlib

from kvpool_agent.policies.base import EvictionPolicy, PolicyFactory
from kvpool_agent.policies.slotlists import SlotArena

_REGISTRY: dict[str, str] = {
    "lru": "kvpool_agent.policies.lru:LRUPolicy",
    "arc": "kvpool_agent.policies.arc:ARCPolicy",
}

POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def policy_factory(name: str) -> PolicyFactory:
    """The policy class registered under ``name``."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known policies are {', '.join(POLICY_NAMES)}"
        ) from None
    module_name, class_name = target.split(":")
    factory: PolicyFactory = getattr(importlib.import_module(module_name), class_name)
    return factory


__all__ = ["POLICY_NAMES", "EvictionPolicy", "PolicyFactory", "SlotArena", "policy_factory"]
