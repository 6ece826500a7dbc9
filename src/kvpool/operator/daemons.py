"""The loop of the operator's periodic kopf daemons (tenants' usage, shared spaces, peer
keys), which ends as soon as kopf asks it to."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import kopf


async def every(stopped: kopf.DaemonStopped, seconds: float, work: Callable[[], None]) -> None:
    """``work`` in a thread every ``seconds`` until kopf stops the daemon.

    The pause races a sleep against kopf's stop flag, untimed: kopf's timed
    ``stopped.wait(seconds)`` runs an ``asyncio.wait_for`` in a task of its own, whose
    timeout, coinciding with the daemon's cancellation at shutdown, can swallow the
    cancellation or come out as a ``TimeoutError`` (seen as an operator failing to stop). Here
    a cancellation is always a cancellation, and the flag ends the pause at once."""
    while not stopped:
        pause = asyncio.ensure_future(asyncio.sleep(seconds))
        stop = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait({pause, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pause.cancel()
            stop.cancel()
        if not stopped:
            await asyncio.to_thread(work)
