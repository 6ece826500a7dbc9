"""Per-key mutual exclusion on the event loop.

Unlike a dict of ``asyncio.Lock``, a free key can be claimed synchronously
(:meth:`KeyLocks.try_claim`): eviction picks victims and claims them in the
same step, so no other operation can slip in between the choice and the unlink.
A key is *busy* while someone holds it or waits for it; the entry is dropped
when the last one leaves, so memory follows the operations in flight.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager


class KeyLocks:
    def __init__(self) -> None:
        self._waiters: dict[Hashable, deque[asyncio.Future[None]]] = {}

    def busy(self, key: Hashable) -> bool:
        return key in self._waiters

    def try_claim(self, key: Hashable) -> bool:
        if key in self._waiters:
            return False
        self._waiters[key] = deque()
        return True

    async def claim(self, key: Hashable) -> None:
        waiters = self._waiters.get(key)
        if waiters is None:
            self._waiters[key] = deque()
            return
        turn = asyncio.get_running_loop().create_future()
        waiters.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if not turn.cancelled():  # the key was handed over just before the cancel
                self.release(key)
            raise

    def release(self, key: Hashable) -> None:
        waiters = self._waiters[key]
        while waiters:
            turn = waiters.popleft()
            if not turn.done():  # skip waiters that were cancelled
                turn.set_result(None)
                return
        del self._waiters[key]

    @asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        await self.claim(key)
        try:
            yield
        finally:
            self.release(key)
