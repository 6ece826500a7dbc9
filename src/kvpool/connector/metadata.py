"""The messages of :mod:`kvpool.connector.jobs` as the vLLM types its connector API
passes between the scheduler and the workers."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvpool.connector.jobs import FormatHandshake, StepJobs, StoresDone


@dataclass
class KVPoolConnectorMetadata(StepJobs, KVConnectorMetadata):
    """Scheduler -> workers, every step."""


@dataclass
class KVPoolConnectorWorkerMetadata(StoresDone, KVConnectorWorkerMetadata):
    """Workers -> scheduler, every step."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPoolConnectorWorkerMetadata)
        return KVPoolConnectorWorkerMetadata(self.merged(other))


@dataclass
class KVPoolConnectorHandshakeMetadata(FormatHandshake, KVConnectorHandshakeMetadata):
    """Each worker -> the scheduler, once."""
