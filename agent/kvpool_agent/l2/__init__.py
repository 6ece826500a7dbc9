"""L2 tiers: async adapters (NVMe files, S3) behind one interface, and a plain registry.

A literal name maps to "module:Class"; modules are imported on first use, so
boto3 is imported only when an S3 tier is configured.
"""

from __future__ import annotations

import importlib

from kvpool_agent.l2.base import L2Adapter, L2Object, ObjectKey

_REGISTRY: dict[str, str] = {
    "nvme": "kvpool_agent.l2.nvme:NvmeAdapter",
    "s3": "kvpool_agent.l2.s3:S3Adapter",
}

ADAPTER_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def adapter_class(name: str) -> type[L2Adapter]:
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown L2 tier {name!r}; known tiers are {', '.join(ADAPTER_NAMES)}"
        ) from None
    module_name, class_name = target.split(":")
    adapter: type[L2Adapter] = getattr(importlib.import_module(module_name), class_name)
    return adapter


__all__ = ["ADAPTER_NAMES", "L2Adapter", "L2Object", "ObjectKey", "adapter_class"]
