"""The agent process's composition root: builds every part, runs them, stops them in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from kvpool_agent.cache_factory import L1Tier, open_l1
from kvpool_agent.config import AgentConfig

log = logging.getLogger(__name__)


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self._l1: L1Tier | None = None
        self._stopping = asyncio.Event()

    @property
    def l1(self) -> L1Tier:
        if self._l1 is None:
            raise RuntimeError("the agent is not started")
        return self._l1

    async def run(self) -> None:
        """Serve until :meth:`stop` is called (SIGTERM and SIGINT call it)."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        self._l1 = open_l1(self.config)
        maintenance = asyncio.create_task(self._maintain(), name="l1-maintenance")
        log.info("agent for pool %r ready", self.config.pool)
        try:
            await self._stopping.wait()
        finally:
            maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await maintenance
            self._l1.close()
            self._l1 = None
            log.info("agent stopped")

    def stop(self) -> None:
        self._stopping.set()

    async def _maintain(self) -> None:
        """Expire leases and hold the watermark between stores (stores also evict on demand)."""
        interval = self.config.maintenance_interval_seconds
        while True:
            await asyncio.sleep(interval)
            self.l1.cache.maintain()
