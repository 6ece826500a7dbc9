"""The checks in order, each skipped with the reason when one it depends on failed.

service -> protocol -> annotations -> agent -> door -> transport -> canary
annotations -> chunk-size, fingerprint, hit-rate, peers, picker
model (the model's config.json alone: it runs whatever the others found)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.client import AgentClient
from kvpool.connector.discovery import AgentAddress
from kvpool.connector.identity import Credential
from kvpool.connector.settings import ConnectorSettings
from kvpool.tools.doctor import (
    agent,
    canary,
    chunk_size,
    fingerprint,
    hit_rate,
    model,
    peers,
    picker,
    shared_memory,
    transport,
)
from kvpool.tools.doctor.address import locate
from kvpool.tools.doctor.report import Check, Outcome, skipped_all


@dataclass(frozen=True)
class Options:
    settings: ConnectorSettings
    """What the connector would be configured with (its extra config and KVPOOL_* overrides)."""
    credential: Credential
    """The token the connector would say hello with."""
    http_url: str | None
    """The agent's HTTP API, when not found through the pool's Service."""
    picker: str | None
    """The endpoint picker's gRPC address, when not the index Service's."""
    admin_token: str | None
    block_size: int | None
    engine: fingerprint.EngineModel
    min_lookups: int
    timeout: float
    model_config: Mapping[str, Any] | None = None
    """The model's config.json (``--model-config``), for the model check."""


AFTER_LOCATE = (
    agent.NAME,
    shared_memory.DOOR,
    transport.NAME,
    canary.NAME,
    chunk_size.NAME,
    fingerprint.NAME,
    hit_rate.NAME,
    peers.NAME,
    picker.NAME,
)


def diagnose(options: Options) -> Iterator[Check]:
    """Run every check, yielding each result as it is known."""
    yield from _deployment(options)
    yield model.check_model(options.model_config)


def _deployment(options: Options) -> Iterator[Check]:
    """The checks of the pool and its agent, as the connector reaches them."""
    checks, located = locate(options.settings, options.http_url)
    yield from checks
    if located is None:
        yield from skipped_all(AFTER_LOCATE, "needs the agent's address (discovery failed)")
        return
    address = located.address
    check, client = agent.reach(address.endpoint, options.credential, options.timeout, located.pool)
    yield check
    if client is None:
        yield from skipped_all(
            (shared_memory.DOOR, transport.NAME, canary.NAME),
            "needs an agent that answers",
        )
    else:
        try:
            yield from _through_the_door(client, address)
        finally:
            client.close()
    yield chunk_size.check_chunk_size(address.chunk_tokens, options.block_size)
    yield fingerprint.check_fingerprint(
        options.engine, address.chunk_tokens, located.kube, located.pool, located.namespace
    )
    yield hit_rate.check_hit_rate(
        located.http_url, options.admin_token, options.min_lookups, options.timeout
    )
    yield peers.check_peers(located.http_url, options.admin_token, options.timeout)
    yield picker.check_picker(
        located.kube, located.pool, located.namespace, options.picker, options.timeout
    )


def _through_the_door(client: AgentClient, address: AgentAddress) -> Iterator[Check]:
    assert client.info is not None
    door = address.door_for(client.info)
    check = shared_memory.check_door(door)
    yield check
    mapped = door is not None and check.outcome is Outcome.PASS
    yield transport.check_transport(door, mapped, client.info)
    if not mapped:
        yield canary.check_canary_inline(client)
        return
    client.door_path = door
    yield canary.check_canary(client)
