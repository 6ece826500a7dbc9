"""The agent process's composition root: builds every part, starts them, stops them in reverse.

Parts: the owner locks (of the segment, of the pool's state directory and NVMe tree),
the L1 segment and cache, the quota store and service, the token authority, metrics, the
ZMQ server (its own thread), the HTTP API (uvicorn on this event loop), the L2 tiers and
the peer tier (its own threads), and the maintenance task. SIGTERM and SIGINT stop it:
readiness turns false, new stores are refused while those in flight may still commit (up
to ``shutdown_grace_seconds``), the servers stop, the segment is unmapped, not removed,
and the locks are let go last: the next agent (one already waiting for them, in a
rollout) adopts the segment with every committed chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from prometheus_client import CollectorRegistry

from kvpool.agent.core.factory import L1Tier, claim_segment, open_l1
from kvpool.agent.edge.door import DoorServer
from kvpool.agent.edge.events import EventPublisher
from kvpool.agent.edge.http_api import create_app
from kvpool.agent.edge.metrics import AgentMetrics
from kvpool.agent.edge.zmq_server import ZmqServer
from kvpool.agent.edge.zmtp import listen as listen_zmq
from kvpool.agent.l2 import L2Adapter, ObjectKey
from kvpool.agent.l2.nvme import NvmeAdapter
from kvpool.agent.l2.tiers import open_tiers
from kvpool.agent.peer.node import PeerTier
from kvpool.agent.service.cache_service import CacheService
from kvpool.agent.service.hooks import TierKeys
from kvpool.agent.tenancy.quota_store import FileQuotaStore
from kvpool.agent.tiering.prefetch import Prefetcher
from kvpool.agent.tiering.writeback import WriteBack
from kvpool.common.auth import GeneratedTokens, TokenAuthority, load_authority
from kvpool.common.config import AgentConfig, make_setting_directory
from kvpool.common.files import FileRefused, LockFile, Undo
from kvpool.common.problems import listening
from kvpool.common.protocol import TIER_NVME, TIER_S3
from kvpool.common.quotas import Quota
from kvpool.common.segment import LOCK_MODE, SegmentInUse, door_path, lock_path
from kvpool.common.tenants_configmap import SpaceEntry, TenantsSnapshot
from kvpool.common.web.connections import HttpRefusals
from kvpool.common.web.serving import listen as listen_http
from kvpool.common.web.serving import serve_http

if TYPE_CHECKING:
    from kvpool.agent.l2.s3 import S3Adapter  # boto3: imported only with an S3 tier
    from kvpool.agent.tenancy.kube_quota_store import KubernetesQuotaStore
    from kvpool.agent.tenancy.tenants_watch import TenantsWatch

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
        file, then the owner locks of the segment, of the pool's state in the state directory
        and of its NVMe tree (each taken once no other agent holds it, waiting up to
        ``handover_seconds`` in all for one that is stopping), then the ports (bound), the
        quota store, the Kubernetes API and pinning. Only then the files: L2 key and tree,
        segment (a new one under a temporary name) and probe table, and the generated tokens
        last; once all is up, a new segment takes its name. A start that fails removes what
        it made, never a segment it adopted or would have replaced, and lets the locks go
        last.
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
        owners: list[LockFile] = []

        def release() -> None:
            while owners:
                owners.pop().release()

        try:
            if await self._claim(owners):
                await self._serve(authority, generated, undo)
        except BaseException:
            undo.run(release)  # a lock file keeps its directory: the locks go before those
            raise
        finally:
            release()
        log.info("agent stopped")

    def _owned(self) -> list[_Owned]:
        """What this agent owns alone while it lives: its segment, its pool's state in the
        state directory (tokens, quota file), and its pool's NVMe tree if it has one."""
        config, pool = self.config, self.config.pool
        segment, state = config.resolved_segment_path, config.state_dir
        owned = [
            _Owned(
                f"segment {segment}",
                lock_path(segment),
                "segment_path",
                lambda: claim_segment(segment),
            ),
            _Owned.beside(
                f"state directory {state} (pool {pool})",
                lambda: make_setting_directory(("state_dir",), state, what="state directory"),
                state / f"agent-{pool}.lock",
                "state_dir",
                what="state directory lock",
            ),
        ]
        if config.nvme is not None:
            root = config.nvme.path
            owned.append(
                _Owned.beside(
                    f"NVMe tier {root / pool}",
                    lambda: make_setting_directory(
                        ("nvme", "path"), root, what="NVMe tier directory"
                    ),
                    root / f"{pool}.lock",
                    "nvme.path",
                    what="NVMe tier directory lock",
                )
            )
        return owned

    async def _claim(self, owners: list[LockFile]) -> bool:
        """Take the owner locks of :meth:`_owned` into ``owners``; False if stopped meanwhile.

        :class:`SegmentInUse` when another agent still holds one after ``handover_seconds``.
        """
        started = asyncio.get_running_loop().time()
        for owned in self._owned():
            lock = await self._claim_one(owned, started)
            if lock is None:
                return False
            owners.append(lock)
        return True

    async def _claim_one(self, owned: _Owned, started: float) -> LockFile | None:
        """The lock of ``owned`` once no other agent holds it; None if stopped meanwhile."""
        wait = self.config.handover_seconds
        loop, holder = asyncio.get_running_loop(), ""
        while True:
            claim = owned.claim()
            waited = loop.time() - started
            if not isinstance(claim, str):
                if holder:
                    log.info("%s: %s exited after %.1f s", owned.name, holder, waited)
                return claim
            if waited >= wait:
                raise SegmentInUse(
                    f"{owned.name} is in use by {claim} (lock {owned.lock}; waited "
                    f"{waited:.1f} s, handover_seconds {wait:g}): stop that agent, or give this "
                    f"one another pool or {owned.setting}"
                )
            if claim != holder:
                holder = claim
                log.warning(
                    "%s is in use by %s: waiting up to %g s (handover_seconds) for it to exit",
                    owned.name,
                    holder,
                    wait,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), min(_CLAIM_POLL_SECONDS, wait))
            if self._stopping.is_set():
                log.info("stopped while waiting for %s", owned.name)
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
            # then what is read or reached: none of them fails once files exist
            quota_store, quotas = self._load_quotas()
            tenants = self._connect_tenants()
            # L2 before L1: a bad NVMe path or key stops the agent before the segment exists
            limits = _NvmeLimits()
            tiers = open_tiers(config, limits, limits.pinned, undo)
            async with contextlib.AsyncExitStack() as opening:
                for tier in tiers:
                    opening.push_async_callback(tier.close)
                peers = None if config.peers is None else PeerTier(config)
                if peers is not None:
                    opening.callback(peers.stop)
                    opening.push_async_callback(peers.adapter.close)
                l1 = open_l1(config, agent_id, undo)
                closing_tiers = opening.pop_all()
            stack.callback(l1.close)
            # the tiers and peers close before L1 is unmapped (a write-back, or a chunk being
            # sealed for a peer, may still read its memory)
            await stack.enter_async_context(closing_tiers)
            service = self._open_service(l1, quota_store, quotas, stack)
            limits.service = service
            own_spaces = self._file_spaces(authority)
            service.replace_spaces(own_spaces)
            if tenants is not None:
                self._follow_tenants(tenants, authority, service, own_spaces, stack)
            metrics = AgentMetrics(
                CollectorRegistry(),
                service,
                config.metrics_top_tenants,
                l1.origin,
                probe_table=l1.probe_table,
            )
            service.publish_events(events, self._tier_events(events, tiers))
            prefetcher = await self._start_l2(l1, service, metrics, tiers, peers=peers, stack=stack)
            zmq_server = ZmqServer(
                service,
                l1.segment,
                f"tcp://{config.host}:{config.zmq_port or '*'}",
                authority=authority,
                agent_id=agent_id,
                max_inline_bytes=int(config.max_inline_bytes),
                session_idle_seconds=10 * config.lease_seconds,
                limits=config.zmq_limits,
                observer=metrics,
                listener=zmq_listener,
                offer=None if peers is None else peers.offers.offer,
            )
            if prefetcher is not None:
                prefetcher.on_change(zmq_server.prefetch_changed)
            app = create_app(
                service,
                authority,
                ready=lambda: self._ready,
                metrics=metrics.exposition,
                limits=config.http_limits,
                peers=None if peers is None else peers.state,
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
            if generated is not None:  # last: a failed start replaces no earlier tokens
                generated.write(undo.file)
            # before any client is served: a connector's first hello finds its door
            stack.callback(self._open_door(l1, authority, metrics).close)
            # started: a new segment takes its name (before a client is served), and from
            # now on every file stays for the next agent
            undo.keep()
            zmq_server.start()
            stack.callback(zmq_server.stop)
            await stack.enter_async_context(self._maintain(l1, service))
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

    @staticmethod
    def _open_door(l1: L1Tier, authority: TokenAuthority, metrics: AgentMetrics) -> DoorServer:
        """The door beside the segment, serving its chunk files to the tokens that may map
        them (counted in ``metrics``)."""
        door = DoorServer(door_path(l1.segment.path), authority, l1.files)
        door.start()
        metrics.register_door(door.stats)
        return door

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
            f"tcp://{config.host}:{config.events_port or '*'}",
            agent_id,
            authority,
            handshake_seconds=config.zmq_limits.hello_seconds,
        )
        with listening("events_port", config.host, config.events_port):
            events.start()
        stack.callback(events.stop)
        return zmq_listener, http_listener, events

    @staticmethod
    def _tier_events(events: EventPublisher, tiers: list[L2Adapter]) -> dict[str, TierKeys]:
        """The L2 tiers publish into the events' sequence (tier ``nvme``, ``s3``); the
        tiers a snapshot lists, by name: NVMe's keys (none without an NVMe tier, so that an
        index forgets what an earlier agent of the node held). S3 is not listed: the agent
        keeps no list of the bucket (listing it would cost a request per 1000 objects of
        the whole pool's bucket, at every resync), so an index learns it from events only.
        """
        listed: dict[str, TierKeys] = {TIER_NVME: dict}
        for tier in tiers:
            if isinstance(tier, NvmeAdapter):
                tier.listener = events.tier(TIER_NVME)
                listed[TIER_NVME] = tier.keys_by_tenant
            elif tier.name == TIER_S3:
                cast("S3Adapter", tier).listener = events.tier(TIER_S3)
        return listed

    def _load_quotas(self) -> tuple[FileQuotaStore | KubernetesQuotaStore, dict[str, Quota]]:
        """The pool's quota store (its ConfigMap, or a local file) and the quotas it holds."""
        config = self.config
        store: FileQuotaStore | KubernetesQuotaStore
        if config.quota_configmap:
            from kvpool.agent.tenancy.kube_quota_store import KubernetesQuotaStore

            store = KubernetesQuotaStore.connect(config.quota_configmap)
        else:
            store = FileQuotaStore(config.resolved_quota_file)
        return store, store.load()

    def _connect_tenants(self) -> TenantsWatch | None:
        """The watch of the tenants ConfigMap (not started), if there is one."""
        if not self.config.tenants_configmap:
            return None
        from kvpool.agent.tenancy.tenants_watch import TenantsWatch

        return TenantsWatch.connect(self.config.tenants_configmap)

    def _open_service(
        self,
        l1: L1Tier,
        store: FileQuotaStore | KubernetesQuotaStore,
        quotas: dict[str, Quota],
        stack: contextlib.AsyncExitStack,
    ) -> CacheService:
        """The cache behind its lock, with the ``quotas`` loaded from ``store``, which a
        ConfigMap store then keeps up to date."""
        service = CacheService(l1.cache, l1.files, store)
        where = store.path if isinstance(store, FileQuotaStore) else store.where
        log.info("loaded %d tenant quotas from %s", service.set_quotas(quotas), where)
        if not isinstance(store, FileQuotaStore):
            store.start(service.replace_quotas)
            stack.callback(store.stop)
        return service

    def _file_spaces(self, authority: TokenAuthority) -> dict[str, SpaceEntry]:
        """The tokens file's shared spaces, as the service lists them (the configured
        default pin budget theirs)."""
        budget = int(self.config.default_pin_budget)
        return {
            space: SpaceEntry("tokens file", access.members, access.owners, budget)
            for space, access in authority.file_spaces.items()
        }

    def _follow_tenants(
        self,
        watch: TenantsWatch,
        authority: TokenAuthority,
        service: CacheService,
        own_spaces: Mapping[str, SpaceEntry],
        stack: contextlib.AsyncExitStack,
    ) -> None:
        """The tenants ConfigMap's tokens join the authority, its ceilings the quotas, its
        shared spaces the authority (who may act for them) and the service (their pin
        budgets, and usage per space)."""
        from kvpool.agent.tenancy.tenants_watch import grants, space_access

        def apply(snapshot: TenantsSnapshot) -> None:
            for _, principal in authority.replace_granted(grants(snapshot)):
                log.error(
                    "%s: a token of %s is also another principal's; refused",
                    watch.where,
                    principal,
                )
            authority.replace_spaces(space_access(snapshot))
            service.replace_spaces({**snapshot.spaces, **own_spaces})
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
        *,
        peers: PeerTier | None,
        stack: contextlib.AsyncExitStack,
    ) -> Prefetcher | None:
        """The write-back to the L2 ``tiers`` and the prefetch from them and from ``peers``
        (between NVMe and S3), attached to the service; this agent serves its peers.

        Returns the prefetcher (None without tiers or peers), whose progress the ZMQ server
        reports.
        """
        config = self.config
        if not tiers and peers is None:
            return None
        loop = asyncio.get_running_loop()
        nvme = next((tier for tier in tiers if isinstance(tier, NvmeAdapter)), None)
        readable = list(tiers)
        if peers is not None:
            readable.insert(0 if nvme is None else 1, peers.adapter)
            peers.serve(service, nvme, loop)

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
            tiers,
            policy=config.store_policy,
            min_hits=config.store_min_hits,
            capacity=config.writeback_queue_chunks,
            capacity_bytes=int(config.l1_size) // 4,
            observe=metrics.observe_l2,
        )
        prefetcher = Prefetcher(service, readable, observe=metrics.observe_l2)
        service.attach_lower_tiers(
            writeback, prefetcher, drop_tenant, None if nvme is None else nvme.tenant_used
        )
        metrics.register_l2(readable, writeback, prefetcher)
        if peers is not None:
            metrics.register_peers(peers)
        for controller in (writeback, prefetcher):
            await controller.start()
            stack.push_async_callback(controller.stop)
        log.info("L2 tiers: %s", ", ".join(tier.name for tier in readable))
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
"""How often a starting agent tries an owner lock again while another holds it."""


@dataclass(frozen=True)
class _Owned:
    """What one agent at a time owns, through the lock at ``lock``: ``claim`` takes it (the
    lock, or who holds it now); ``setting`` gives another agent one of its own."""

    name: str
    lock: Path
    setting: str
    claim: Callable[[], LockFile | str]

    @classmethod
    def beside(
        cls, name: str, make_directory: Callable[[], object], lock: Path, setting: str, *, what: str
    ) -> _Owned:
        """Owned through a lock file (``what`` it is) in a directory that ``make_directory``
        checks, or makes, first."""

        def claim() -> LockFile | str:
            make_directory()
            try:
                return LockFile.claim(lock, what=what, mode=LOCK_MODE)
            except FileRefused:
                raise
            except OSError as error:
                raise OSError(f"cannot lock {name} ({lock}): {error.strerror}") from None

        return cls(name, lock, setting, claim)


class _NvmeLimits:
    """The tenants' NVMe limits and their pinned chunks, for the L2 tiers, which open before
    the service exists (nothing is put into them before it does)."""

    service: CacheService | None = None

    def __call__(self, tenant: str) -> int | None:
        return None if self.service is None else self.service.nvme_quota_limit(tenant)

    def pinned(self, name: ObjectKey) -> bool:
        return self.service is not None and self.service.is_pinned(name.tenant, name.key)
