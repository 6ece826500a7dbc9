"""Workers of the worker half against a real agent, with small CPU caches standing in for
vLLM's (shared by the worker tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvpool.client import AgentInfo
from kvpool.common import keys
from kvpool.connector.counters import Counters
from kvpool.connector.discovery import AgentAddress
from kvpool.connector.jobs import StepJobs, StoreJob
from kvpool.connector.layout import GroupRule
from kvpool.connector.settings import Transport
from kvpool.connector.worker import KVPoolConnectorWorker
from tests.support.agent_process import AgentProcess

from .agent_link import agent_link

BLOCKS, HEADS, BLOCK_TOKENS, CONTENT = 16, 2, 4, 8
CHUNK = 2 * BLOCK_TOKENS
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
TENANT = keys.tenant_id("worker-test")
KEYS = [bytes([index]) * 32 for index in range(4)]


def worker_of(
    agent: AgentProcess,
    layers: dict[str, torch.Tensor],
    groups: list[tuple[GroupRule, list[str]]],
    *,
    num_blocks: int = BLOCKS,
    chunk_tokens: int = CHUNK,
    content: str = "TEST",
    door: Path | None = None,
    transport: Transport = "auto",
) -> KVPoolConnectorWorker:
    """A worker of ``agent`` with these caches (``layers``: name -> tensor); it maps chunk
    files from ``door`` if given, else from the agent's (with the transport ``messages``,
    none)."""
    address = AgentAddress(agent.zmq, None, chunk_tokens, transport, door)
    counters = Counters()
    holder: list[KVPoolConnectorWorker] = []

    def on_new_agent(info: AgentInfo) -> None:
        holder[0].on_new_agent(info)

    worker = KVPoolConnectorWorker(
        rank=0,
        link=agent_link(agent, counters, "worker", on_new_agent),
        counters=counters,
        chunk_tokens=lambda: chunk_tokens,
        door_path=address.door_for,
    )
    holder.append(worker)
    worker.register_kv_caches(layers, groups, num_blocks, content)
    return worker


def cpu_caches(seed: int | None) -> list[torch.Tensor]:
    """One ``[blocks, heads, tokens, content]`` bf16 tensor per layer: zeros, or random."""
    shape = (BLOCKS, HEADS, BLOCK_TOKENS, CONTENT)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in LAYERS]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in LAYERS]


def make_worker(
    agent: AgentProcess,
    seed: int | None,
    door: Path | None = None,
    transport: Transport = "auto",
) -> tuple[KVPoolConnectorWorker, list[torch.Tensor]]:
    """A worker of one full-attention group; it maps chunk files from ``door`` if given,
    else from the agent's (with the transport ``messages``, none)."""
    caches = cpu_caches(seed)
    layers = dict(zip(LAYERS, caches, strict=True))
    groups = [(GroupRule("full", 4), LAYERS)]
    return worker_of(agent, layers, groups, door=door, transport=transport), caches


def store(
    worker: KVPoolConnectorWorker, job_id: int, chunk_keys: list[bytes], block_ids: list[int]
) -> None:
    job = StoreJob(job_id, f"r{job_id}", TENANT, (tuple(chunk_keys),), (None,), (tuple(block_ids),))
    worker.save(StepJobs(stores=[job]))
