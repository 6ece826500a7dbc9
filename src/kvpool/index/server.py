"""``kvpool-index``: the prefix index process. Composition root: builds every part,
starts them, stops them in reverse.

Parts: the gateway token authority, the trackers (one per tier), the event subscriber (its own
thread), the discovery (static, or a Kubernetes watch thread), metrics, and
the HTTP API (uvicorn on this event loop). It is ready (``/readyz``) once it
holds a synchronised copy of every agent discovery named, or after
``warmup_seconds`` without one (then it routes with what it has). SIGTERM and
SIGINT stop it: readiness turns false, then the HTTP server, discovery and
subscriber stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from kvpool.client import read_token
from kvpool.common.auth import (
    GeneratedTokens,
    TokenAuthority,
    TokenFileError,
    load_authority,
)
from kvpool.common.config import load_settings
from kvpool.common.files import Undo
from kvpool.common.index_config import IndexConfig, StaticAgent
from kvpool.common.kube.discovery import (
    AgentEndpoint,
    Discovery,
    KubernetesDiscovery,
    StaticDiscovery,
)
from kvpool.common.names import INDEX_CONFIG_FILE_ENV
from kvpool.common.problems import (
    ArgumentParser,
    ConfigError,
    Loc,
    exit_with,
    listening,
    show,
    start_logging,
)
from kvpool.common.web.connections import HttpRefusals
from kvpool.common.web.serving import listen, serve_http
from kvpool.index.endpoint_picker import EndpointPickerService
from kvpool.index.http_api import create_app
from kvpool.index.metrics import IndexMetrics
from kvpool.index.peer_lookups import PeerLookups
from kvpool.index.picker import Tiers
from kvpool.index.service import IndexService
from kvpool.index.subscriber import EventSubscriber
from kvpool.index.tracker import TierTrackers

log = logging.getLogger(__name__)


def make_discovery(config: IndexConfig) -> Discovery:
    if config.discovery == "kubernetes":
        return KubernetesDiscovery.connect(config.pool, config.namespace)
    return StaticDiscovery(agent.endpoint() for agent in config.agents)


class IndexServer:
    def __init__(
        self,
        config: IndexConfig,
        authority: TokenAuthority,
        agent_token: str,
        discovery: Discovery,
        generated: GeneratedTokens | None = None,
        *,
        peer_lookups: PeerLookups | None = None,
    ) -> None:
        """``agent_token``: what the index follows the agents with (an index token);
        ``generated``: the authority's tokens, written once the index has started;
        ``peer_lookups``: the agents' lookup tokens, with a peer credential."""
        self.config = config
        self._peer_lookups = peer_lookups
        self._authority = authority
        self._generated = generated
        self._agent_token = agent_token
        self._discovery = discovery
        self._stopping = asyncio.Event()
        self._ready = False
        self._warm_by = time.monotonic() + config.warmup_seconds
        self._warmed = False
        self.trackers = TierTrackers.create(config.max_chunks_per_node)
        """What each node holds, tier by tier (the subscriber fills them; lookups and
        routes answer from ``l1``)."""

    def _warm(self, subscriber: EventSubscriber) -> bool:
        """Whether the index has caught up with every agent once, or stopped waiting to."""
        self._warmed = self._warmed or (subscriber.caught_up() or time.monotonic() >= self._warm_by)
        return self._warmed

    def stop(self) -> None:
        self._ready = False
        self._stopping.set()

    def _write_tokens(self, generated: GeneratedTokens) -> None:
        """The generated token's file, last of the start: if it cannot be written, the
        state directory is removed again if this made it."""
        undo = Undo()
        undo.directories(self.config.state_dir)
        try:
            generated.write(undo.file)
        except BaseException:
            undo.run()
            raise

    async def run(self) -> None:
        """Serve until :meth:`stop` is called (SIGTERM and SIGINT call it).

        The HTTP port is bound first (in use: one line naming it, nothing started), the
        generated token is written last: a failed start leaves no file, and replaces no
        token of an index already running.
        """
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        config, discovery = self.config, self._discovery
        trackers = self.trackers
        tracker = trackers.l1
        subscriber = EventSubscriber(
            tracker,
            tiers=trackers.lower(),
            token=self._agent_token,
            snapshot_timeout=config.snapshot_timeout_seconds,
            receive_hwm=config.receive_hwm,
        )
        metrics = IndexMetrics(CollectorRegistry(), tracker, subscriber.status)
        refusals = HttpRefusals()
        metrics.register_http(refusals)
        service = IndexService(tracker, config.routing_policy(), metrics)
        app = create_app(
            service,
            self._authority,
            subscriber.status,
            default_fingerprint=config.fingerprint,
            ready=lambda: self._ready and self._warm(subscriber),
            metrics=metrics.exposition,
            limits=config.http_limits,
        )
        picking = None
        if config.picker.enabled:
            tiers = Tiers(l1=tracker, nvme=trackers.nvme, s3=trackers.s3)
            picking = EndpointPickerService(config, tiers, metrics)
        async with contextlib.AsyncExitStack() as stack:
            with listening("http_port", config.host, config.http_port):
                listener = listen(config.host, config.http_port)
            stack.callback(listener.close)
            picker_port = None
            if picking is not None:
                picker_port = picking.start()  # OSError naming picker.port: nothing started
                stack.callback(picking.stop)
            if self._peer_lookups is not None:
                granting = asyncio.create_task(self._peer_lookups.follow())
                stack.callback(granting.cancel)
            subscriber.start()
            stack.callback(subscriber.stop)
            discovery.start(subscriber.follow)
            stack.callback(discovery.stop)
            http_url = await stack.enter_async_context(
                serve_http(
                    app,
                    config.host,
                    config.http_port,
                    config.http_limits,
                    refusals,
                    listener=listener,
                )
            )
            if self._generated is not None:
                self._write_tokens(self._generated)
            self._ready = True
            log.info(
                "index ready pool=%s http=%s discovery=%s picker=%s",
                config.pool,
                http_url,
                config.discovery,
                f"{config.host}:{picker_port}" if picker_port is not None else "off",
            )
            await self._stopping.wait()
            self._ready = False
        log.info("index stopped")


def main(argv: Sequence[str] | None = None) -> int:
    """``kvpool-index [--config FILE] [--agent NODE=ZMQ,EVENTS ...]``."""
    prog = "kvpool-index"
    parser = ArgumentParser(
        prog=prog,
        description=(
            "Follow the chunk events of a pool's agents and answer gateways' route and lookup "
            "requests over HTTP. Settings come from KVPOOL_INDEX_* environment variables and "
            "an optional YAML/JSON file (see docs/reference/settings.md)."
        ),
    )
    parser.add_argument(
        "--config", help=f"YAML or JSON file of index settings (or ${INDEX_CONFIG_FILE_ENV})"
    )
    parser.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NODE=ZMQ,EVENTS",
        help="an agent to follow, e.g. gpu-1=tcp://10.0.0.5:7400,tcp://10.0.0.5:7402 "
        "(repeat for each; implies static discovery)",
    )
    parser.add_log_level()
    args = parser.parse_args(argv)
    start_logging(args.log_level)
    if args.config:
        os.environ[INDEX_CONFIG_FILE_ENV] = args.config
    try:
        if args.agent:
            agents = []
            for text in args.agent:
                try:
                    agents.append(AgentEndpoint.parse(text))
                except ValueError as error:
                    raise ConfigError([f"--agent {show(text)}: {error}"]) from None
            flags: dict[Loc, tuple[str, object]] = {
                ("agents", number): ("--agent", text) for number, text in enumerate(args.agent)
            }
            flags[("discovery",)] = ("--agent", args.agent[0])
            config = load_settings(
                IndexConfig,
                flags,
                discovery="static",
                agents=[StaticAgent(node=a.node, zmq=a.zmq, events=a.events) for a in agents],
            )
        else:
            config = load_settings(IndexConfig)
    except ConfigError as error:
        return exit_with(prog, error)
    try:
        authority, generated = load_authority(
            config.tokens_file, {"admins": config.generated_token_file}
        )
        agent_token = read_token(config.resolved_agent_token_file)
        discovery = make_discovery(config)
        peer_lookups = None
        if config.peer_key_dir is not None:  # a key directory without a key: KeyringError
            peer_lookups = PeerLookups(authority, config.peer_key_dir, config.pool)
    except (TokenFileError, ValueError, OSError) as error:  # a token file's error too
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    try:
        server = IndexServer(
            config, authority, agent_token, discovery, generated, peer_lookups=peer_lookups
        )
        asyncio.run(server.run())
    except ConfigError as error:  # the port in use
        return exit_with(prog, error)
    except OSError as error:  # the token file refused, or not written
        print(f"{prog}: {error}", file=sys.stderr)
        return 1
    return 0
