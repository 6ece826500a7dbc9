"""The configurations ``kvpool bench cluster`` compares: which servers, which gateway."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.tools.bench.cluster.cluster import Flavor


@dataclass(frozen=True)
class Config:
    number: int
    name: str
    flavor: Flavor
    picker: bool


CONFIGS = (
    Config(1, "round robin, vLLM prefix cache", Flavor.PLAIN, picker=False),
    Config(2, "round robin + kvpool pool", Flavor.KVPOOL, picker=False),
    Config(3, "kvpool picker, vLLM prefix cache", Flavor.PLAIN, picker=True),
    Config(4, "kvpool picker + pool", Flavor.KVPOOL, picker=True),
    Config(5, "round robin + LMCache server", Flavor.LMCACHE, picker=False),
    Config(6, "kvpool picker + pool, P/D", Flavor.DISAGG, picker=True),
)
COLOCATED = 4
"""Configuration 6's own servers colocated (the same count, each prefilling and decoding):
the P/D table's ratios are to it."""


def names() -> dict[int, str]:
    """Each configuration's name, by its number."""
    return {config.number: config.name for config in CONFIGS}
