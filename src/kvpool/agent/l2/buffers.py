"""Buffers for whole chunks: reused where their contents stay inside the adapter, and
fresh ones faulted in at once where they leave it.

A fresh buffer of tens of MiB is a new mapping (it is above glibc's largest mmap
threshold), faulted in 4 KiB at a time: under a hypervisor that costs about as much
as AES-GCM over the same bytes (``kvpool bench l2``). A buffer borrowed from the
:class:`BufferPool` is already faulted in: a ciphertext on its way to a file or a
request goes through one. What ``get`` returns must be a buffer of its own, which
:func:`fresh` makes cheap to fill.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy

DEFAULT_IDLE_BYTES = 128 << 20


def fresh(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes of its own, not zeroed: filled by a read, the
    kernel faults its pages in as it copies (no fault per page from user space), and
    numpy asks for huge pages for a large one."""
    return numpy.empty(size, numpy.uint8).data


class BufferPool:
    """Reusable bytearrays; idle ones are kept up to ``max_idle_bytes`` in all."""

    def __init__(self, max_idle_bytes: int = DEFAULT_IDLE_BYTES) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[bytearray] = []
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self, size: int) -> Iterator[memoryview]:
        """``size`` writable bytes (not zeroed), the pool's again when the block ends."""
        buffer = self._take(size)
        view = memoryview(buffer)
        try:
            with view[:size] as borrowed:
                yield borrowed
        finally:
            view.release()
            self._give_back(buffer)

    def _take(self, size: int) -> bytearray:
        with self._lock:
            fits = [b for b in self._idle if len(b) >= size]
            if fits:
                buffer = min(fits, key=len)
                self._idle.remove(buffer)
                self._idle_bytes -= len(buffer)
                return buffer
        return bytearray(size)

    def _give_back(self, buffer: bytearray) -> None:
        with self._lock:
            if self._idle_bytes + len(buffer) <= self.max_idle_bytes:
                self._idle.append(buffer)
                self._idle_bytes += len(buffer)
