"""``KvpoolConnector``: the class vLLM loads; it only wires the settings and delegates.

vLLM builds one instance per role: in the scheduler process it drives a
:class:`~kvpool.connector.scheduler.KVPoolConnectorScheduler`, in each worker a
:class:`~kvpool.connector.worker.KVPoolConnectorWorker`. Each half has its own
:class:`~kvpool.connector.link.AgentLink` (the scheduler's with the short
``lookup_timeout_s``) and its own counters.

A best-effort cache must never fail a request, so the scheduler role sets
vLLM's ``kv_load_failure_policy`` to ``recompute`` (with a warning if it was
``fail``, vLLM's default): a chunk that disappears between lookup and load is
then recomputed, not an error.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput

from kvpool.client import AgentInfo
from kvpool.connector import discovery, identity
from kvpool.connector.compat import check_vllm_version
from kvpool.connector.counters import Counters
from kvpool.connector.groups import (
    CachedGroup,
    NotCacheable,
    cacheable_groups,
    cannot_resume,
    loads_per_request,
    state_block_size,
)
from kvpool.connector.layout import LayoutError
from kvpool.connector.link import AgentLink
from kvpool.connector.metadata import (
    KVPoolConnectorHandshakeMetadata,
    KVPoolConnectorMetadata,
    KVPoolConnectorWorkerMetadata,
)
from kvpool.connector.metrics import KVPoolConnectorPromMetrics, KVPoolConnectorStats
from kvpool.connector.scheduler import KVPoolConnectorScheduler
from kvpool.connector.settings import ConnectorSettings
from kvpool.connector.worker import KVPoolConnectorWorker

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

try:  # the hybrid KV cache manager's interface (several KV cache groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    _HMA: tuple[type, ...] = (SupportsHMA,)
except ImportError:
    _HMA = ()

try:  # vLLM 0.32+ labels a connector's hits by the tier that served them
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HIT_SOURCE: CacheHitSource | None = CacheHitSource.HOST
except ImportError:  # vLLM 0.30, 0.31
    _HIT_SOURCE = None

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 256


def _log_with_vllm() -> None:
    """Send kvpool's records where vLLM sends its own (vLLM configures only its ``vllm``
    logger; without this our INFO lines would vanish and warnings would lose the format)."""
    ours, theirs = logging.getLogger("kvpool"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return  # the process configured logging for us, or vLLM's logging is off
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


class KvpoolConnector(KVConnectorBase_V1, *_HMA):  # type: ignore[misc]
    """vLLM connector that shares KV through the node's kvpool agent (see the package docs).

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``): every KV cache group is
    cached as :mod:`~kvpool.connector.groups` says, so vLLM keeps the manager on.
    """

    if _HIT_SOURCE is not None:
        _cache_hit_source = _HIT_SOURCE  # loads come from the node's shared memory

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_with_vllm()
        check_vllm_version(vllm.__version__)
        extra = self._kv_transfer_config.kv_connector_extra_config
        settings, no_agent = ConnectorSettings.for_engine(extra)
        self._settings = settings
        self._credential = identity.credential(settings)
        self._counters = Counters()
        self._scheduler: KVPoolConnectorScheduler | None = None
        self._worker: KVPoolConnectorWorker | None = None
        self._address: discovery.AgentAddress | None = None
        self._groups, disabled = (
            _groups(vllm_config, kv_cache_config) if no_agent is None else ([], no_agent)
        )
        if disabled is not None and role == KVConnectorRole.SCHEDULER:
            log.warning("kvpool: %s", disabled)  # once per engine: the scheduler's
        if role == KVConnectorRole.SCHEDULER:
            self._require_recompute()
            model = vllm_config.model_config
            self._scheduler = KVPoolConnectorScheduler(
                model=_model_identity(settings.model_name or model.model, vllm_config),
                dtype=str(model.dtype).removeprefix("torch."),
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                groups=[group.rule for group in self._groups],
                link=self._link("scheduler", settings.lookup_timeout_s),
                counters=self._counters,
                prefetch_wait_s=settings.prefetch_wait_s,
                step_budget_s=settings.step_budget_ms / 1000,
                segment_path=self._segment_path,
                disabled=disabled,
                loads_per_request=loads_per_request(kv_cache_config, self._groups),
                kv_role=self._kv_transfer_config.kv_role or "kv_both",
                decode_wait_s=settings.decode_wait_s,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = KVPoolConnectorWorker(
                rank=get_tensor_model_parallel_rank(),
                link=self._link("worker", settings.transfer_timeout_s, self._on_new_agent),
                counters=self._counters,
                chunk_tokens=self._chunk_tokens,
                door_path=self._door_path,
            )

    # ------------------------------------------------------------ wiring

    def _link(
        self,
        role: str,
        timeout: float,
        on_new_agent: Callable[[AgentInfo], None] | None = None,
    ) -> AgentLink:
        return AgentLink(
            self._resolve,
            credential=self._credential,
            role=role,
            timeout=timeout,
            retry_min_s=self._settings.retry_min_s,
            retry_max_s=self._settings.retry_max_s,
            counters=self._counters,
            on_new_agent=on_new_agent,
        )

    def _resolve(self) -> discovery.AgentAddress:
        if self._address is None:
            self._address = discovery.resolve(self._settings)
        return self._address

    def _chunk_tokens(self) -> int:
        """The chunk size: the pool's (the engine's setting, the pool's Service, 256), but
        one block for a model with state-space layers."""
        state = state_block_size(self._groups)
        if state is not None:
            log.info(
                "kvpool: %d-token chunks (one block) for this model, whatever the pool's: "
                "vLLM keeps a state-space layer's state only at a block's end, where a hit "
                "must end",
                state,
            )
            return state
        if self._settings.chunk_tokens is not None:
            return self._settings.chunk_tokens
        try:
            advertised = self._resolve().chunk_tokens
        except discovery.DiscoveryError as error:
            log.warning("kvpool: %s; using %d-token chunks", error, DEFAULT_CHUNK_TOKENS)
            return DEFAULT_CHUNK_TOKENS
        return advertised or DEFAULT_CHUNK_TOKENS

    def _segment_path(self, info: AgentInfo) -> Path | None:
        return self._resolve().segment_for(info)

    def _door_path(self, info: AgentInfo) -> Path | None:
        return self._resolve().door_for(info)

    def _on_new_agent(self, info: AgentInfo) -> None:
        assert self._worker is not None
        self._worker.on_new_agent(info)

    def _require_recompute(self) -> None:
        config = self._kv_transfer_config
        if config.kv_load_failure_policy != "recompute":
            log.warning(
                "kvpool: setting kv_load_failure_policy='recompute' (was %r): chunks the cache "
                "loses between lookup and load are recomputed, never an error",
                config.kv_load_failure_policy,
            )
            config.kv_load_failure_policy = "recompute"

    @property
    def scheduler(self) -> KVPoolConnectorScheduler:
        assert self._scheduler is not None, "a scheduler method called on a worker connector"
        return self._scheduler

    @property
    def worker(self) -> KVPoolConnectorWorker:
        assert self._worker is not None, "a worker method called on a scheduler connector"
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a lost store is a future miss, nothing more

    def _metadata(self) -> KVPoolConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        return meta

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        if not self._groups:
            return  # not cached (the scheduler said why): no handshake, no hits
        layer_names = [name for group in self._groups for name in group.layer_names]
        backends = get_current_attn_backends(self._vllm_config, layer_names)
        try:
            self.worker.register_kv_caches(
                kv_caches,
                [(group.rule, group.layer_names) for group in self._groups],
                self._kv_cache_config.num_blocks,
                "+".join(sorted(backend.get_name() for backend in backends)),
            )
        except LayoutError as error:  # never fail vLLM's start: serve without the cache
            log.warning("kvpool: %s; this engine gets no hits from kvpool", error)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        handshake = self.worker.handshake
        return (
            None
            if handshake is None
            else KVPoolConnectorHandshakeMetadata(**dataclasses.asdict(handshake))
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVPoolConnectorMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole chunks of every layer, done in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None  # stores copy whole chunks after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return (results.finished_sending or None), (results.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        received, failed = self.worker.take_received()
        return KVConnectorTransferResults(
            finished_sending=self.worker.get_finished(finished_req_ids),
            finished_recving=received,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        done = self.worker.build_worker_meta()
        return None if done is None else KVPoolConnectorWorkerMetadata(done.completed_stores)

    # ------------------------------------------------------------ scheduler side

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        handshakes = {
            rank: meta
            for rank, meta in metadata.items()
            if isinstance(meta, KVPoolConnectorHandshakeMetadata)
        }
        self.scheduler.configure(handshakes)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        self.scheduler.update_connector_output(
            meta if isinstance(meta, KVPoolConnectorWorkerMetadata) else None,
            set(connector_output.finished_sending or ()),
            set(getattr(connector_output, "failed_recving", None) or ()),
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_work()

    # ------------------------------------------------------------ both

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        counts = self._counters.take()
        return KVPoolConnectorStats(data=counts) if counts else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVPoolConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVPoolConnectorPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


def _groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[list[CachedGroup], str | None]:
    """The groups to cache, or none and why (an engine kvpool must not hand KV to)."""
    reason = cannot_resume(vllm_config)
    if reason is not None:
        return [], reason
    try:
        return cacheable_groups(kv_cache_config), None
    except NotCacheable as error:
        return [], str(error)


def _model_identity(name: str, vllm_config: VllmConfig) -> str:
    """The model part of the key fingerprint: the name, and what else changes the weights."""
    model = vllm_config.model_config
    identity = name
    if model.revision:
        identity += f"@{model.revision}"
    if model.quantization:
        identity += f"+{model.quantization}"
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":  # fp8 kinds are all uint8 pages: the descriptor cannot tell
        identity += f"+kv:{cache_dtype}"
    return identity
