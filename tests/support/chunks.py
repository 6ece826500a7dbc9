"""Chunk keys and bytes for tests that store into real agents or caches."""

from __future__ import annotations

import hashlib
import random


def key(name: str | int) -> bytes:
    """A chunk key (32 bytes) named by ``name``: the same name, the same key."""
    return hashlib.sha256(str(name).encode()).digest()


def chain(name: str, length: int) -> list[bytes]:
    """``length`` opaque keys standing for one prompt's chain."""
    return [key(f"{name}/{position}") for position in range(length)]


def data(name: int | str, size: int = 60_000) -> bytes:
    """``size`` pseudo-random bytes named by ``name`` (60,000: one 64 KiB page)."""
    return random.Random(f"l2-{name}").randbytes(size)
