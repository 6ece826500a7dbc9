"""A worker that cannot reach the agent's door (a pod the webhook did not wire, a pod whose
/dev/shm is its own): its chunks travel through the agent's protocol, against a real agent
process, and are the same chunks a worker on the chunk files stores and loads."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvpool.client import AgentClient
from kvpool.connector.jobs import LoadJob, StepJobs
from kvpool.connector.worker import KVPoolConnectorWorker
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.metrics import metric

from .workers import KEYS, TENANT, make_worker, store

pytestmark = pytest.mark.process

NOWHERE = Path("/nonexistent/kvpool-door.sock")
"""A door path this pod does not have (nothing mounted)."""
CHUNK_BYTES = 512
"""Two blocks of two layers of ``2 x 4 x 8`` bf16: the workers' chunk."""


def load(
    target_agent: AgentProcess, door: Path | None, keys: list[bytes], blocks: list[int]
) -> tuple[KVPoolConnectorWorker, list[torch.Tensor]]:
    """A new worker (zeroed caches) that loads ``keys`` into ``blocks``."""
    worker, caches = make_worker(target_agent, seed=None, door=door)
    job = LoadJob("reader", TENANT, (tuple(keys),), (tuple(blocks),), first_tokens=0)
    worker.start_load(StepJobs(loads=[job]))
    return worker, caches


def test_chunks_travel_through_the_agent_and_match_the_chunk_files(
    empty_agent: AgentProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    writer, written = make_worker(empty_agent, seed=1, door=NOWHERE)
    store(writer, 1, KEYS[:2], [3, 4, 5, 6])
    store(writer, 2, KEYS[2:], [7, 8, 9, 10])
    assert writer.counters.totals["stored_chunks"] == 4
    said = [
        r.getMessage() for r in caplog.records if "moving KV through the agent" in r.getMessage()
    ]
    assert len(said) == 1 and f"no agent's door at {NOWHERE}" in said[0]

    for door in (NOWHERE, None):  # a reader without the door, and one with it
        reader, loaded = load(empty_agent, door, KEYS, [11, 12, 13, 14, 1, 2, 15, 9])
        assert reader.take_load_errors() == set()
        assert reader.counters.totals["loaded_chunks"] == 4
        for before, after in zip(written, loaded, strict=True):
            assert torch.equal(
                after[[11, 12, 13, 14, 1, 2, 15, 9]], before[[3, 4, 5, 6, 7, 8, 9, 10]]
            )

    mapped, on_files = make_worker(empty_agent, seed=2)  # and the other way round
    store(mapped, 3, [bytes([9]) * 32], [2, 3])
    reader, loaded = load(empty_agent, NOWHERE, [bytes([9]) * 32], [5, 6])
    assert reader.take_load_errors() == set()
    for before, after in zip(on_files, loaded, strict=True):
        assert torch.equal(after[[5, 6]], before[[2, 3]])


def test_the_transport_messages_maps_no_chunk_file_even_where_it_could(
    empty_agent: AgentProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """The transport ``messages``: its chunks travel through the agent, and the agent's
    door, which this process could reach, is not used."""
    caplog.set_level(logging.INFO)
    writer, written = make_worker(empty_agent, seed=5, transport="messages")
    store(writer, 1, KEYS[:2], [3, 4, 5, 6])
    reader, loaded = load(empty_agent, None, KEYS[:2], [7, 8, 9, 10])

    assert reader.take_load_errors() == set()
    for before, after in zip(written, loaded, strict=True):
        assert torch.equal(after[[7, 8, 9, 10]], before[[3, 4, 5, 6]])
    mapped = [r for r in caplog.records if "maps chunk files" in r.getMessage()]
    assert len(mapped) == 1  # the reader's (the transport "auto"); the writer mapped nothing
    said = [r for r in caplog.records if "transport=messages" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


def test_a_miss_without_the_door_is_reported_for_recompute(empty_agent: AgentProcess) -> None:
    writer, _ = make_worker(empty_agent, seed=3, door=NOWHERE)
    store(writer, 1, KEYS[:1], [3, 4])
    reader, loaded = load(empty_agent, NOWHERE, KEYS[:3], [5, 6, 7, 8, 9, 10])
    assert reader.take_load_errors() == {7, 8, 9, 10}
    assert reader.counters.totals["loaded_chunks"] == 1
    assert not any(cache[[7, 8, 9, 10]].any() for cache in loaded)


def test_a_job_larger_than_one_message_goes_in_batches(agent_process: AgentProcess) -> None:
    """At most 2.5 chunks per message: four chunks go as two, two; the chain holds."""
    agent_process.settings["MAX_INLINE_BYTES"] = str(CHUNK_BYTES * 5 // 2)
    agent = agent_process.start()
    writer, written = make_worker(agent, seed=4, door=NOWHERE)
    store(writer, 1, KEYS, [1, 2, 3, 4, 5, 6, 7, 8])
    assert writer.counters.totals["stored_chunks"] == 4
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        assert client.lookup(TENANT, KEYS, lock=False).count == 4
    assert metric(agent, 'kvpool_request_seconds_count{op="store_inline"}') == 2
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:  # the agent bounds its replies
        assert len(client.retrieve_inline(TENANT, KEYS)) == 2

    reader, loaded = load(agent, NOWHERE, KEYS, [9, 10, 11, 12, 13, 14, 15, 1])
    assert reader.take_load_errors() == set()
    assert metric(agent, 'kvpool_request_seconds_count{op="retrieve_inline"}') == 3
    for before, after in zip(written, loaded, strict=True):
        assert torch.equal(after[[9, 10, 11, 12, 13, 14, 15, 1]], before[[1, 2, 3, 4, 5, 6, 7, 8]])


def test_a_chunk_too_large_for_a_message_is_not_cached(
    agent_process: AgentProcess, caplog: pytest.LogCaptureFixture
) -> None:
    agent_process.settings["MAX_INLINE_BYTES"] = str(CHUNK_BYTES - 1)
    agent = agent_process.start()
    writer, _ = make_worker(agent, seed=5, door=NOWHERE)
    store(writer, 1, KEYS[:2], [1, 2, 3, 4])
    store(writer, 2, KEYS[2:], [5, 6, 7, 8])
    assert writer.counters.totals["stored_chunks"] == 0
    assert writer.counters.totals["failed_stores"] == 2
    said = [r.getMessage() for r in caplog.records if "cannot travel" in r.getMessage()]
    assert said == [
        f"kvpool worker 0: no agent's door at {NOWHERE}, and a "
        f"chunk ({CHUNK_BYTES} bytes) is larger than the agent's "
        f"max_inline_bytes ({CHUNK_BYTES - 1}), so it cannot travel through the agent either: "
        "nothing is loaded or stored"
    ]
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        assert client.lookup(TENANT, KEYS, lock=False).count == 0
