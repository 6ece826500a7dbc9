"""The agent process's composition root: builds every part, starts them, stops them in reverse.

Parts: the segment's owner lock, the L1 segment and cache, the quota store and
service, the token authority, metrics, the ZMQ server (its own thread), the HTTP
API (uvicorn on this event loop) and the maintenance task. SIGTERM and SIGINT stop
it: readiness turns false, new stores are refused while those in flight may still
commit (up to ``shutdown_grace_seconds``), the servers stop, the segment is
unmapped, not removed, and the lock is let go last: the next agent (one already
waiting for it, in a rollout) adopts the segment with every committed chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

from prometheus_client import CollectorRegistry

from kvpool_agent.config import AgentConfig
from kvpool_agent.core.factory import L1Tier, claim_segment, open_l1
from kvpool_agent.edge.events import EventPublisher
from kvpool_agent.edge.http_api import create_app
from kvpool_agent.edge.metrics import AgentMetrics
from kvpool_agent.edge.zmq_server import ZmqServer
from kvpool_agent.edge.zmtp import listen as listen_zmq
from kvpool_agent.files import LockFile, Undo, ensure_directory
from kvpool_agent.l2 import L2Adapter
from kvpool_agent.l2.nvme import NvmeAdapter
from kvpool_agent.l2.tiers import open_tiers
from kvpool_agent.problems import listening
from kvpool_agent.segment import SegmentInUse, lock_path
from kvpool_agent.service.cache_service import CacheService
from kvpool_agent.tenancy.auth import GeneratedTokens, TokenAuthority, load_authority
from kvpool_agent.tenancy.quota_store import FileQuotaStore
from kvpool_agent.tenants_configmap import TenantsSnapshot
from kvpool_agent.tiering.prefetch import Prefetcher
from kvpool_agent.tiering.writeback import WriteBack
from kvpool_agent.web.connections import HttpRefusals
from kvpool_agent.web.serving import listen as listen_http
from kvpool_agent.web.serving import serve_http

log = logging.getLogger(__name__)


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self._stopping = asyncio.Event()
        self._ready = False

    def stop(self) -> None:
        self._ready = False
        self._stopping.set()

    async def run(self) -> None:
        """Serve until :meth:`stop` is called (SIGTERM and SIGINT call it).

        What can be checked is checked before anything is made: the settings, the tokens
        file, then the segment's owner lock (taken once no other agent holds it, waiting up
        to ``handover_seconds`` for one that is stopping), then the ports (bound). Only then
        the files: state directory, L2 key and tree, segment and probe table, and the
        generated tokens last. A start that fails removes what it made, never a segment it
        adopted, and lets the lock go last.
        """
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        config = self.config
        authority, generated = load_authority(config.tokens_file, config.generated_token_files)
        undo = Undo()
        undo.directories(config.state_dir, config.resolved_segment_path.parent)
        if config.nvme is not None or config.s3 is not None:
            undo.directories(config.resolved_l2_key_dir)
        if config.nvme is not None:
            undo.directories(config.nvme.path / config.pool)
        owner: LockFile | None = None
        try:
            owner = await self._claim_segment()
            if owner is not None:
                await self._serve(authority, generated, undo)
        except BaseException:
            undo.run()
            raise
        finally:
            if owner is not None:
                owner.release()
        log.info("agent stopped")

    async def _claim_segment(self) -> LockFile | None:
        """The segment's owner lock, once no other agent holds it; None if stopped meanwhile.

        :class:`SegmentInUse` when another agent still holds it after ``handover_seconds``.
        """
        path, wait = self.config.resolved_segment_path, self.config.handover_seconds
        loop = asyncio.get_running_loop()
        started, holder = loop.time(), ""
        while True:
            claim = claim_segment(path)
            waited = loop.time() - started
            if not isinstance(claim, str):
                if holder:
                    log.info("segment %s: %s exited after %.1f s", path, holder, waited)
                return claim
            if waited >= wait:
                raise SegmentInUse(
                    f"segment {path} is in use by {claim} (lock {lock_path(path)}; waited "
                    f"{waited:.1f} s, handover_seconds {wait:g}): stop that agent, or give this "
                    "one another pool or segment_path"
                )
            if claim != holder:
                holder = claim
                log.warning(
                    "segment %s is in use by %s: waiting up to %g s (handover_seconds) for it "
                    "to exit",
                    path,
                    holder,
                    wait,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), min(_CLAIM_POLL_SECONDS, wait))
            if self._stopping.is_set():
                log.info("stopped while waiting for segment %s", path)
                return None

    async def _serve(
        self, authority: TokenAuthority, generated: GeneratedTokens | None, undo: Undo
    ) -> None:
        """Start every part (noting in ``undo`` what it makes), serve, stop in reverse."""
        config = self.config
        async with contextlib.AsyncExitStack() as stack:
            agent_id = uuid.uuid4().hex
            # the ports, before any file: one in use stops the agent here
            zmq_listener, http_listener, events = self._listen(agent_id, authority, stack)
            ensure_directory(config.state_dir, what="state directory")
            # L2 before L1: a bad NVMe path or key stops the agent before the segment exists
            limits = _NvmeLimits()
            tiers = open_tiers(config, limits, undo)
            async with contextlib.AsyncExitStack() as opening:
                for tier in tiers:
                    opening.push_async_callback(tier.close)
                l1 = open_l1(config, agent_id, undo)
                closing_tiers = opening.pop_all()
            stack.callback(l1.close)
            # the tiers close before L1 is unmapped (a write-back may still hold its memory)
            await stack.enter_async_context(closing_tiers)
            service = self._open_service(l1, stack)
            limits.service = service
            self._follow_tenants(authority, service, stack)
            metrics = AgentMetrics(
                CollectorRegistry(),
                service,
                config.metrics_top_tenants,
                l1.origin,
                probe_table=l1.probe_table,
            )
            service.publish_events(events)
            prefetcher = await self._start_l2(l1, service, metrics, tiers, stack)
            zmq_server = ZmqServer(
                service,
                l1.segment,
                f"tcp://{config.host}:{config.zmq_port or '*'}",
                authority=authority,
                agent_id=agent_id,
                max_inline_bytes=int(config.max_inline_bytes),
                session_idle_seconds=10 * config.lease_seconds,
                observer=metrics,
                listener=zmq_listener,
            )
            if prefetcher is not None:
                prefetcher.on_change(zmq_server.prefetch_changed)
            zmq_server.start()
            stack.callback(zmq_server.stop)
            app = create_app(
                service,
                authority,
                ready=lambda: self._ready,
                metrics=metrics.exposition,
                limits=config.http_limits,
            )
            refusals = HttpRefusals()
            metrics.register_http(refusals)
            http_url = await stack.enter_async_context(
                serve_http(
                    app,
                    config.host,
                    config.http_port,
                    config.http_limits,
                    refusals,
                    listener=http_listener,
                )
            )
            await stack.enter_async_context(self._maintain(l1, service))
            if generated is not None:  # last: a failed start replaces no earlier tokens
                generated.write(undo.file)
            undo.keep()  # started: from now on every file stays for the next agent
            self._ready = True
            log.info(
                "agent ready pool=%s zmq=%s http=%s segment=%s events=%s",
                config.pool,
                zmq_server.bound_endpoint,
                http_url,
                l1.segment.path,
                events.bound_endpoint,
            )
            await self._stopping.wait()
            self._ready = False
            zmq_server.drain()
            drained = await asyncio.to_thread(
                zmq_server.drained.wait, config.shutdown_grace_seconds
            )
            log.info(
                "agent stopping: %s",
                "no store in flight" if drained else "grace period over, stores in flight dropped",
            )

    def _listen(
        self, agent_id: str, authority: TokenAuthority, stack: contextlib.AsyncExitStack
    ) -> tuple[socket.socket, socket.socket, EventPublisher]:
        """The ZMQ and HTTP ports bound, and the events port publishing: a port in use (or
        an address the host lacks) is one line naming its setting."""
        config = self.config
        with listening("zmq_port", config.host, config.zmq_port):
            zmq_listener = listen_zmq(f"tcp://{config.host}:{config.zmq_port or '*'}")
        stack.callback(zmq_listener.close)
        with listening("http_port", config.host, config.http_port):
            http_listener = listen_http(config.host, config.http_port)
        stack.callback(http_listener.close)
        events = EventPublisher(
            f"tcp://{config.host}:{config.events_port or '*'}", agent_id, authority
        )
        with listening("events_port", config.host, config.events_port):
            events.start()
        stack.callback(events.stop)
        return zmq_listener, http_listener, events

    def _open_service(self, l1: L1Tier, stack: contextlib.AsyncExitStack) -> CacheService:
        """The cache behind its lock, with quotas from the pool's ConfigMap or a local file."""
        config = self.config
        if config.quota_configmap:
            from kvpool_agent.tenancy.kube_quota_store import KubernetesQuotaStore

            shared = KubernetesQuotaStore.connect(config.quota_configmap)
            service = CacheService(l1.cache, l1.segment, shared)
            log.info("loaded %d tenant quotas from %s", service.load_quotas(), shared.where)
            shared.start(service.replace_quotas)
            stack.callback(shared.stop)
            return service
        service = CacheService(l1.cache, l1.segment, FileQuotaStore(config.resolved_quota_file))
        log.info(
            "loaded %d tenant quotas from %s", service.load_quotas(), config.resolved_quota_file
        )
        return service

    def _follow_tenants(
        self, authority: TokenAuthority, service: CacheService, stack: contextlib.AsyncExitStack
    ) -> None:
        """With a tenants ConfigMap: its tokens join the authority, its ceilings the quotas."""
        if not self.config.tenants_configmap:
            return
        from kvpool_agent.tenancy.tenants_watch import TenantsWatch, grants

        watch = TenantsWatch.connect(self.config.tenants_configmap)

        def apply(snapshot: TenantsSnapshot) -> None:
            for _, principal in authority.replace_granted(grants(snapshot)):
                log.error(
                    "%s: a token of %s is also another principal's; refused",
                    watch.where,
                    principal,
                )
            service.replace_ceilings(snapshot.ceilings())

        watch.add_listener(apply)
        watch.start()
        stack.callback(watch.stop)

    async def _start_l2(
        self,
        l1: L1Tier,
        service: CacheService,
        metrics: AgentMetrics,
        tiers: list[L2Adapter],
        stack: contextlib.AsyncExitStack,
    ) -> Prefetcher | None:
        """The write-back and prefetch of the L2 ``tiers``, attached to the service.

        Returns the prefetcher (None without tiers), whose progress the ZMQ server reports.
        """
        config = self.config
        if not tiers:
            return None
        loop = asyncio.get_running_loop()

        def shrink_tiers(tenant: str) -> None:  # any thread: HTTP handlers, the quota watch
            for tier in tiers:
                asyncio.run_coroutine_threadsafe(tier.enforce_quota(tenant), loop)

        service.quota_listeners.append(shrink_tiers)

        def drop_tenant(tenant: str) -> int:  # an HTTP handler's thread
            async def every_tier() -> int:
                # every tier runs to its end, even when another fails
                results = await asyncio.gather(
                    *(tier.drop_tenant(tenant) for tier in tiers), return_exceptions=True
                )
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
                return sum(cast(list[int], results))

            return asyncio.run_coroutine_threadsafe(every_tier(), loop).result()

        writeback = WriteBack(
            service,
            l1.segment,
            tiers,
            policy=config.store_policy,
            min_hits=config.store_min_hits,
            capacity=config.writeback_queue_chunks,
            capacity_bytes=int(config.l1_size) // 4,
            observe=metrics.observe_l2,
        )
        prefetcher = Prefetcher(service, tiers, observe=metrics.observe_l2)
        nvme = next((tier for tier in tiers if isinstance(tier, NvmeAdapter)), None)
        service.attach_lower_tiers(
            writeback, prefetcher, drop_tenant, None if nvme is None else nvme.tenant_used
        )
        metrics.register_l2(tiers, writeback, prefetcher)
        for controller in (writeback, prefetcher):
            await controller.start()
            stack.push_async_callback(controller.stop)
        log.info("L2 tiers: %s", ", ".join(tier.name for tier in tiers))
        return prefetcher

    @contextlib.asynccontextmanager
    async def _maintain(self, l1: L1Tier, service: CacheService) -> AsyncIterator[None]:
        """Expire leases and hold the watermark between stores (stores also evict on demand)."""

        async def loop() -> None:
            displaced: list[Path] = []
            while True:
                await asyncio.sleep(self.config.maintenance_interval_seconds)
                service.maintain()
                now = l1.displaced()
                if now and now != displaced:
                    log.error(
                        "%s no longer named this agent's (removed or replaced by someone "
                        "else: another agent, a person?): clients that map that name now "
                        "see another file; restart this agent",
                        " and ".join(map(str, now)),
                    )
                displaced = now

        task = asyncio.create_task(loop(), name="l1-maintenance")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


_CLAIM_POLL_SECONDS = 0.1
"""How often a starting agent tries the segment's owner lock again while another holds it."""


class _NvmeLimits:
    """The tenants' NVMe limits, for the L2 tiers, which open before the service exists
    (nothing is put into them before it does)."""

    service: CacheService | None = None

    def __call__(self, tenant: str) -> int | None:
        return None if self.service is None else self.service.nvme_quota_limit(tenant)
