"""The endpoint picker in the index process: its model servers, its core, its gRPC edge.

It runs in ``kvpool-index`` (when ``picker.enabled``), not beside it: a decision reads the
index's trackers in process, so it costs the prompt's key hashing and a few dictionary
probes, no round trip; and the picker needs everything the index follows anyway. When the
index cannot answer in time (its trackers busy, a huge prompt) the core picks by load
alone (:mod:`~kvpool.index.picker`); when the whole process is gone, the gateway fails open
(the InferencePool's ``failureMode: FailOpen``), so a gateway never answers 5xx because the
cache is down.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvpool.common.auth import TokenAuthority
from kvpool.common.disagg import read_key
from kvpool.common.index_config import IndexConfig
from kvpool.common.problems import ConfigError
from kvpool.index.engine_events import EngineEvents, EngineEventsCollector, event_endpoints
from kvpool.index.epp import EppServer
from kvpool.index.metrics import IndexMetrics
from kvpool.index.model_servers import ModelServers, ServerEndpoint
from kvpool.index.picker import EndpointPicker, Tiers
from kvpool.index.placement_events import PlacementPublisher
from kvpool.index.placements import PlacementFeed
from kvpool.index.prompts import Prompts, PromptsError
from kvpool.index.tracker import PrefixTracker, TierTrackers

log = logging.getLogger(__name__)


def placement_feed(config: IndexConfig, trackers: TierTrackers) -> PlacementFeed | None:
    """The placement events' feed, where ``picker.placement_events`` asks for them (its
    tier sinks go between the agents' subscriber and the trackers)."""
    picker = config.picker
    if not picker.enabled or picker.placement_events is None:
        return None
    assert config.fingerprint is not None  # IndexConfig refuses a picker without one
    publisher = PlacementPublisher(
        picker.placement_events,
        picker.placement_events_replay,
        connect=picker.placement_events_connect,
    )
    model = picker.served_model_name or config.fingerprint.model
    return PlacementFeed(publisher, {"l1": trackers.l1, **trackers.lower()}, model)


class EndpointPickerService:
    """Start and stop the picker's parts together; built only with ``picker.enabled``.

    The model servers' discovery drives whom the GPU tier follows: each server's vLLM KV
    events (:mod:`~kvpool.index.engine_events`) fill a tracker of its own, keyed by the
    server's address, that joins the index's node tiers in :class:`Tiers`."""

    def __init__(
        self,
        config: IndexConfig,
        tiers: Tiers,
        metrics: IndexMetrics,
        feed: PlacementFeed | None = None,
        *,
        authority: TokenAuthority | None = None,
    ) -> None:
        """``ConfigError`` (one line) when the tokenizer directory or the disaggregation key
        does not load."""
        picker_config = config.picker
        assert config.fingerprint is not None  # IndexConfig refuses a picker without one
        prompts = None
        if picker_config.tokenizer is not None:
            try:
                prompts = Prompts.load(picker_config.tokenizer)
            except PromptsError as error:
                raise ConfigError([f"picker.tokenizer: {error}"]) from None
        prefill_key = None
        if picker_config.pd.enabled:
            key_file = picker_config.pd.key_file
            assert key_file is not None  # PrefillDecode refuses pd without one
            try:
                prefill_key = read_key(key_file)
            except (OSError, ValueError) as error:
                raise ConfigError([f"picker.pd.key_file: {error}"]) from None
        fingerprint = config.fingerprint.fingerprint()
        self.feed = feed
        if feed is not None:
            metrics.register_placements(feed.publisher.status)
        self.engine_events = EngineEvents(
            fingerprint,
            PrefixTracker(config.max_chunks_per_node),
            on_chunk=feed.chunk_blocks if feed is not None else None,
        )
        metrics.registry.register(EngineEventsCollector(self.engine_events.status))
        self.servers = ModelServers.of_config(
            picker_config, config.namespace, on_change=self._servers_changed
        )
        self._picker_config = picker_config
        self.picker = EndpointPicker(
            self.servers.snapshot,
            replace(tiers, gpu=self.engine_events.tracker),
            fingerprint,
            picker_config.tier_costs,
            deadline_ms=picker_config.deadline_ms,
            pd=picker_config.pd,
            observer=metrics,
        )
        self.edge = EppServer(
            self.picker,
            picker_config,
            config.host,
            prompts,
            authority=authority if picker_config.require_token else None,
            prefill_key=prefill_key,
        )
        metrics.register_picker(self.edge.answers.snapshot, self.servers.snapshot)
        self.port = 0

    def start(self) -> int:
        """Serve; the bound gRPC port. ``OSError`` naming the address if it is taken (or
        the placement events' endpoints)."""
        if self.feed is not None:
            self.feed.publisher.start()
        self.engine_events.start()
        self.servers.start()
        try:
            self.port = self.edge.start()
        except BaseException:
            self._stop_followers()
            raise
        return self.port

    def stop(self) -> None:
        self.edge.stop()
        self._stop_followers()

    def _stop_followers(self) -> None:
        self.servers.stop()
        self.engine_events.stop()
        if self.feed is not None:
            self.feed.publisher.stop()

    def _servers_changed(self, servers: list[ServerEndpoint]) -> None:
        addresses = (server.address for server in servers)
        self.engine_events.follow(event_endpoints(addresses, self._picker_config))
        if self.feed is not None:
            self.feed.servers(servers)
