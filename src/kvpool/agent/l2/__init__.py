"""L2 tiers: async adapters (NVMe files, S3) behind one interface, and a plain registry.

A literal name maps to a function that imports its adapter's module on first use, so
boto3 is imported only when an S3 tier is configured.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.agent.l2.base import L2Adapter, L2Object, ObjectKey


def _nvme() -> type[L2Adapter]:
    from kvpool.agent.l2.nvme import NvmeAdapter

    return NvmeAdapter


def _s3() -> type[L2Adapter]:
    from kvpool.agent.l2.s3 import S3Adapter  # boto3

    return S3Adapter


_REGISTRY: dict[str, Callable[[], type[L2Adapter]]] = {"nvme": _nvme, "s3": _s3}

ADAPTER_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def adapter_class(name: str) -> type[L2Adapter]:
    try:
        load = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown L2 tier {name!r}; known tiers are {', '.join(ADAPTER_NAMES)}"
        ) from None
    return load()


__all__ = ["ADAPTER_NAMES", "L2Adapter", "L2Object", "ObjectKey", "adapter_class"]
