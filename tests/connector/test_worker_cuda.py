"""The worker half on a GPU: vLLM's FlashAttention layout as CUDA tensors, the agent's chunk
files mapped from its door (pageable), copies on the copier's side stream, against a real
agent process.

Skipped without a CUDA device (the same worker code runs on CPU in ``test_worker.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvpool.client import AgentClient
from kvpool.common import keys
from kvpool.connector.copier import BlockCopier, MappedChunks
from kvpool.connector.jobs import LoadJob, StepJobs, StoreJob
from kvpool.connector.layout import ChunkFormat, GroupRule, detect_layout
from kvpool.connector.staged import StagedCopies
from kvpool.connector.worker import KVPoolConnectorWorker
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess

from .workers import worker_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCKS, BLOCK_TOKENS, HEADS, HEAD = 97, 16, 8, 128
"""A block count no other dimension is a multiple of (vLLM's is in the thousands)."""
CHUNK = 2 * BLOCK_TOKENS
LAYERS = [f"model.layers.{index}.self_attn.attn" for index in range(4)]
TENANT = keys.tenant_id("cuda-test")
KEYS = [bytes([index + 1]) * 32 for index in range(4)]
FULL = GroupRule("full", BLOCK_TOKENS)
WINDOW = GroupRule("window", BLOCK_TOKENS, BLOCK_TOKENS - 1)
"""A chunk of two blocks keeps its last one."""


def flash_attention_caches(seed: int | None) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, kv_heads, head_size]`` tensor per layer, as vLLM's
    FlashAttention backend allocates it (zeros, or random with ``seed``)."""
    shape = (2, BLOCKS, BLOCK_TOKENS, HEADS, HEAD)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in LAYERS]
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(shape, generator=generator, device="cuda").to(torch.bfloat16) for _ in LAYERS
    ]


def make_worker(
    agent: AgentProcess,
    seed: int | None,
    groups: list[tuple[GroupRule, list[str]]],
    door: Path | None = None,
) -> tuple[KVPoolConnectorWorker, list[torch.Tensor]]:
    """A worker with FlashAttention caches on the GPU; it maps chunk files from ``door`` if
    given, else from the agent's."""
    caches = flash_attention_caches(seed)
    worker = worker_of(
        agent,
        dict(zip(LAYERS, caches, strict=True)),
        groups,
        num_blocks=BLOCKS,
        chunk_tokens=CHUNK,
        content="FA",
        door=door,
    )
    return worker, caches


STORED_FROM, LOADED_INTO = [7, 3, 12, 40], [50, 9, 21, 33]
"""The blocks of two chunks (``KEYS[:2]``) a test stores, and those a reader loads them into."""


def load_into_other_blocks(
    agent: AgentProcess, stored: list[torch.Tensor], door: Path | None = None
) -> list[torch.Tensor]:
    """A new worker (zeroed caches) loads ``KEYS[:2]`` into :data:`LOADED_INTO`; the forward
    reads them on the compute stream right away and must see the stored blocks. Its caches."""
    target, loaded = make_worker(agent, seed=None, groups=[(FULL, LAYERS)], door=door)
    load = LoadJob("r2", TENANT, (tuple(KEYS[:2]),), (tuple(LOADED_INTO),), first_tokens=0)
    target.start_load(StepJobs(loads=[load]))
    seen = [cache[:, LOADED_INTO].clone() for cache in loaded]
    assert target.take_load_errors() == set()
    for before, after in zip(stored, seen, strict=True):
        assert torch.equal(after, before[:, STORED_FROM])
    target.close()
    return loaded


def test_a_chunk_stored_from_gpu_blocks_loads_into_other_gpu_blocks(
    empty_agent: AgentProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvpool.connector.worker")
    source, stored = make_worker(empty_agent, seed=1, groups=[(FULL, LAYERS)])
    assert source.handshake is not None and not source.handshake.stores_complete_in_step
    job = StoreJob(1, "r1", TENANT, (tuple(KEYS[:2]),), (None,), (tuple(STORED_FROM),))
    source.save(StepJobs(stores=[job]))
    torch.cuda.synchronize()
    source.get_finished(set())  # commits the stores whose copies have finished
    assert source.counters.totals["stored_chunks"] == 2
    assert "maps chunk files from the agent's door" in caplog.text

    loaded = load_into_other_blocks(empty_agent, stored)
    untouched = [block for block in range(BLOCKS) if block not in LOADED_INTO]
    assert not any(cache[:, untouched].any() for cache in loaded)
    source.close()


def test_a_window_group_on_gpu_loads_per_request_beside_the_forward(
    empty_agent: AgentProcess,
) -> None:
    groups = [(FULL, LAYERS[:2]), (WINDOW, LAYERS[2:])]
    source, stored = make_worker(empty_agent, seed=2, groups=groups)
    job = StoreJob(1, "r1", TENANT, (tuple(KEYS[:2]),), (None,), ((1, 2, 3, 4), (5, 6, 7, 8)))
    source.save(StepJobs(stores=[job]))  # a window's store finishes in its step
    assert source.counters.totals["stored_chunks"] == 2

    target, loaded = make_worker(empty_agent, seed=None, groups=groups)
    load = LoadJob(
        "r2", TENANT, (tuple(KEYS[:2]),), ((9, 10, 11, 12), (0, 0, 0, 13)), 0, per_request=True
    )
    target.start_load(StepJobs(loads=[load]))
    received, failed = target.take_received()
    assert received == {"r2"} and failed == set()
    full, window = loaded[:2], loaded[2:]
    for before, after in zip(stored[:2], full, strict=True):
        assert torch.equal(after[:, [9, 10, 11, 12]], before[:, [1, 2, 3, 4]])
    for before, after in zip(stored[2:], window, strict=True):
        assert torch.equal(after[:, 13], before[:, 8])
        assert not after[:, [block for block in range(BLOCKS) if block != 13]].any()
    source.close()
    target.close()


def test_gpu_blocks_travel_through_the_agents_messages_without_the_segment(
    empty_agent: AgentProcess,
) -> None:
    """A pod that mounts nothing: stores copy out to host memory and go in the agent's
    messages; loads come back the same way into other GPU blocks."""
    nowhere = Path("/nonexistent/kvpool-door.sock")
    source, stored = make_worker(empty_agent, seed=5, groups=[(FULL, LAYERS)], door=nowhere)
    job = StoreJob(1, "r1", TENANT, (tuple(KEYS[:2]),), (None,), (tuple(STORED_FROM),))
    source.save(StepJobs(stores=[job]))
    assert source.counters.totals["stored_chunks"] == 2

    load_into_other_blocks(empty_agent, stored, door=nowhere)
    source.close()


def test_the_agent_never_creates_a_cuda_context(agent: AgentProcess) -> None:
    maps = Path(f"/proc/{agent.pid}/maps").read_text()
    assert "libcuda" not in maps


def test_a_store_copies_what_the_compute_stream_wrote_before_it(agent: AgentProcess) -> None:
    """The blocks are written by kernels still running when the store is issued (a forward):
    the side stream must wait for them, or it copies stale bytes."""
    caches = flash_attention_caches(seed=3)
    layouts = [detect_layout(cache, BLOCKS) for cache in caches]
    chunk_format = ChunkFormat.of([(FULL, layouts)], CHUNK, "FA")
    copier = BlockCopier(
        [[layout.blocks(cache) for layout, cache in zip(layouts, caches, strict=True)]],
        chunk_format,
    )
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        info = client.connect()
        plan = client.prepare_store(TENANT, [KEYS[3]], [chunk_format.chunk_bytes])
        assert plan.lease is not None and plan.offsets[0] >= 0
        segment = MappedChunks(client.files(), info.segment_identity)
        try:
            chunk = segment.chunk(plan.file, plan.offsets[0], chunk_format.chunk_bytes, write=True)
            chunk.zero_()
            slow = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):  # keeps the compute stream busy well past the store's issue
                slow = slow @ slow / 64
            for cache in caches:
                cache[:, [5, 6]] = 1.0  # the forward's last write, queued behind the products
            copier.store(chunk, [[5, 6]]).wait()
            (pages,) = chunk_format.views(chunk)
            assert bool((pages.float() == 1.0).all())
            del chunk, pages
        finally:
            segment.close()
            client.release(plan.lease)


def test_chunks_of_many_slabs_round_trip_through_both_staging_buffers(
    agent: AgentProcess,
) -> None:
    """Slabs of one layer each: every chunk takes four slabs through the two alternating
    buffers, three chunks back to back, stores then loads, without waiting in between."""
    caches = flash_attention_caches(seed=4)
    layouts = [detect_layout(cache, BLOCKS) for cache in caches]
    chunk_format = ChunkFormat.of([(FULL, layouts)], CHUNK, "FA")
    views = [[layout.blocks(cache) for layout, cache in zip(layouts, caches, strict=True)]]
    layer_bytes = chunk_format.chunk_bytes // len(LAYERS)
    staged = StagedCopies(views, chunk_format, slab_bytes=layer_bytes)
    sources, targets = [[3, 70], [15, 4], [88, 9]], [[20, 21], [60, 2], [30, 96]]
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        info = client.connect()
        chunk_keys = [bytes([200 + index]) * 32 for index in range(3)]
        plan = client.prepare_store(TENANT, chunk_keys, [chunk_format.chunk_bytes] * 3)
        assert plan.lease is not None and min(plan.offsets) >= 0
        segment = MappedChunks(client.files(), info.segment_identity)
        try:
            size = chunk_format.chunk_bytes
            chunks = [segment.chunk(plan.file, offset, size, write=True) for offset in plan.offsets]
            for chunk, ids in zip(chunks, sources, strict=True):
                staged.store(chunk, [ids])
            done = [
                staged.load(chunk, [(0, ids)]) for chunk, ids in zip(chunks, targets, strict=True)
            ]
            done[-1].synchronize()
            staged.synchronize()
            for cache in caches:
                for source, target in zip(sources, targets, strict=True):
                    assert torch.equal(cache[:, target], cache[:, source])
            del chunks
        finally:
            segment.close()
            client.release(plan.lease)
