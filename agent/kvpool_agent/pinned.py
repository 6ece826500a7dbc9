"""Optional CUDA pinning of a mapped segment (cudaHostRegister through torch).

Pinning lets a client DMA between GPU blocks and the segment. It is never
required: torch is imported only here, only when asked, so an agent that is
not configured to pin never creates a CUDA context.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Literal

log = logging.getLogger(__name__)

PinMode = Literal["never", "auto", "always"]


class PinningError(RuntimeError):
    """Pinning was required (mode "always") but could not be done."""


class PinnedRegion:
    """A registered host range; :meth:`release` unregisters it."""

    def __init__(self, address: int, size: int, anchor: ctypes.c_char) -> None:
        self.address = address
        self.size = size
        self._anchor: ctypes.c_char | None = anchor  # keeps the mmap exported while pinned

    def release(self) -> None:
        if self._anchor is None:
            return
        import torch

        torch.cuda.cudart().cudaHostUnregister(self.address)  # type: ignore[no-untyped-call]
        self._anchor = None


def check(mode: PinMode) -> None:
    """:class:`PinningError` if ``mode`` requires pinning and CUDA is not there to do it (an
    agent checks this before it makes its segment)."""
    reason = _cuda_unavailable_reason() if mode == "always" else None
    if reason is not None:
        raise PinningError(f"pin_memory=always but {reason}")


def pin(mapping: mmap.mmap, mode: PinMode) -> PinnedRegion | None:
    """Pin ``mapping`` according to ``mode``; None when not pinned (and why is logged)."""
    if mode == "never":
        return None
    check(mode)
    reason = _cuda_unavailable_reason()
    if reason is not None:
        log.info("segment not pinned: %s", reason)
        return None
    import torch

    anchor = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(anchor)
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    status = cudart.cudaHostRegister(address, len(mapping), 0)
    if int(status) != 0:
        message = f"cudaHostRegister failed with status {int(status)}"
        if mode == "always":
            raise PinningError(message)
        log.warning("segment not pinned: %s", message)
        return None
    return PinnedRegion(address, len(mapping), anchor)


def _cuda_unavailable_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None
