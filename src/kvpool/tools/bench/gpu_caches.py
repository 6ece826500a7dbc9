"""vLLM's KV cache layouts as the GPU holds them, built with random contents for ``kvpool bench
gpu`` (and its test), and the block ids a chunk's copies address.

Each :class:`CacheModel` is one engine's per-layer tensors as its attention backend allocates
them (vLLM's ``get_kv_cache_shape``), at real models' sizes:

* ``llama3-8b``: FlashAttention, ``[2, num_blocks, 16, 8, 128]`` bf16, 32 layers: the block
  dimension is the second, so a block's K and V are two 32 KiB runs, one in each half of the
  tensor;
* ``small-heads``: the same backend for a model with 2 KV heads of 64 (Qwen2.5-0.5B): 4 KiB
  runs, 24 layers;
* ``mla``: DeepSeek V3's latent cache, ``[num_blocks, 16, 576]`` bf16 (512 latent + 64 rope
  dims), 61 layers: one run per block;
* ``gemma3-window``: Gemma 3 12B, heads of 256, every 6th of 48 layers full attention and the
  others a 1024-token sliding window: two KV cache groups, the window's keeping only the
  blocks a request needs to resume at a chunk's end.
"""

from __future__ import annotations

import functools
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvpool.client import AgentClient
from kvpool.common.transfer_results import StorePlan
from kvpool.connector.copier import BlockCopier, Copy, MappedChunks
from kvpool.connector.layout import (
    NULL_BLOCK,
    BlockLayout,
    ChunkFormat,
    GroupRule,
    detect_layout,
)

BLOCK_TOKENS = 16
"""vLLM's default block size on GPUs."""


@dataclass(frozen=True)
class CacheModel:
    name: str
    what: str
    groups: tuple[tuple[GroupRule, int], ...]
    """Each KV cache group's rule and layer count, in vLLM's order."""
    shape: tuple[int, ...]
    """One layer's tensor; -1 where the blocks go."""
    dtype: torch.dtype = torch.bfloat16

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return tuple(num_blocks if size == -1 else size for size in self.shape)

    def block_bytes(self) -> int:
        """Bytes of one block of every layer."""
        layers = sum(count for _, count in self.groups)
        return layers * math.prod(size for size in self.shape if size != -1) * self.dtype.itemsize


def _full(layers: int) -> tuple[tuple[GroupRule, int], ...]:
    return ((GroupRule("full", BLOCK_TOKENS), layers),)


MODELS = {
    model.name: model
    for model in (
        CacheModel(
            "llama3-8b", "FlashAttention, 32 x [2,B,16,8,128]", _full(32), (2, -1, 16, 8, 128)
        ),
        CacheModel(
            "small-heads", "FlashAttention, 24 x [2,B,16,2,64]", _full(24), (2, -1, 16, 2, 64)
        ),
        CacheModel("mla", "MLA latent, 61 x [B,16,576]", _full(61), (-1, 16, 576)),
        CacheModel(
            "gemma3-window",
            "8 full + 40 window-1024 x [2,B,16,8,256]",
            (
                (GroupRule("full", BLOCK_TOKENS), 8),
                (GroupRule("window", BLOCK_TOKENS, 1023), 40),
            ),
            (2, -1, 16, 8, 256),
        ),
    )
}


@dataclass
class Caches:
    """One engine's KV caches on ``device``: per group, one tensor per layer."""

    model: CacheModel
    tensors: list[list[torch.Tensor]]
    num_blocks: int

    @classmethod
    def random(cls, model: CacheModel, num_blocks: int, device: torch.device, seed: int) -> Caches:
        generator = torch.Generator(device=device).manual_seed(seed)
        shape = model.layer_shape(num_blocks)
        tensors = [
            [
                torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(
                    model.dtype
                )
                for _ in range(layers)
            ]
            for _, layers in model.groups
        ]
        return cls(model, tensors, num_blocks)

    @functools.cached_property
    def layouts(self) -> list[list[BlockLayout]]:
        return [
            [detect_layout(tensor, self.num_blocks) for tensor in group] for group in self.tensors
        ]

    def chunk_format(self, chunk_tokens: int) -> ChunkFormat:
        return ChunkFormat.of(
            [
                (rule, layouts)
                for (rule, _), layouts in zip(self.model.groups, self.layouts, strict=True)
            ],
            chunk_tokens,
            "BENCH",
        )

    @functools.cached_property
    def block_views(self) -> list[list[torch.Tensor]]:
        """What :class:`BlockCopier` takes: per group, each layer as ``[num_blocks, *page]``."""
        return [
            [layout.blocks(tensor) for layout, tensor in zip(layouts, group, strict=True)]
            for layouts, group in zip(self.layouts, self.tensors, strict=True)
        ]


def scattered_blocks(num_blocks: int, count: int, seed: int) -> list[int]:
    """``count`` distinct block ids in random order, never the null block (vLLM's free list
    hands out blocks scattered over the cache after a while)."""
    ids = [block for block in range(num_blocks) if block != NULL_BLOCK]
    random.Random(seed).shuffle(ids)
    if count > len(ids):
        raise ValueError(f"{count} blocks asked of a cache of {num_blocks}")
    return ids[:count]


def kept_ids(chunk_format: ChunkFormat, blocks: list[int]) -> list[list[int]]:
    """Per group, the ids of a chunk's blocks that the group keeps (its last ``kept``)."""
    return [blocks[group.first_kept : group.blocks_per_chunk] for group in chunk_format.groups]


def timed(device: torch.device, issue: Callable[[], Sequence[Copy] | None]) -> float:
    """Seconds from issuing the copies to their end (the host waits for every stream)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for copy in issue() or ():
        copy.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def check_round_trip(
    caches: Caches,
    chunk_format: ChunkFormat,
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    what: str,
) -> None:
    for source, target in zip(sources, targets, strict=True):
        for group, views, kept_from, kept_to in zip(
            chunk_format.groups,
            caches.block_views,
            kept_ids(chunk_format, list(source)),
            kept_ids(chunk_format, list(target)),
            strict=True,
        ):
            for layer, view in enumerate(views):
                if not torch.equal(view[kept_to], view[kept_from]):
                    raise SystemExit(
                        f"{what}: layer {layer} of the {group.rule.name} group loaded other "
                        "bytes than were stored"
                    )


@dataclass(frozen=True)
class Rig:
    """What every part of the bench copies with: the agent's client, its chunk files mapped
    here (from its door), and the device of the caches."""

    client: AgentClient
    files: MappedChunks
    device: torch.device


def batch_size(chunk_bytes: int, budget: int, most: int) -> int:
    """How many chunks make about ``budget`` bytes: at least one, at most ``most``."""
    return max(1, min(most, budget // chunk_bytes))


def chunk_bytes(name: str, tokens: int) -> int:
    """Bytes of one ``tokens``-token chunk of model ``name``."""
    return (
        Caches.random(MODELS[name], 3, torch.device("cpu"), seed=0).chunk_format(tokens).chunk_bytes
    )


@dataclass
class ChunkCopies:
    """``count`` chunks' worth of blocks of one engine, copied with the worker's copier: the
    chunks' blocks are stored from ``sources`` and loaded into ``targets`` (other blocks)."""

    caches: Caches
    format: ChunkFormat
    copier: BlockCopier
    sources: list[list[int]]
    targets: list[list[int]]

    @classmethod
    def make(
        cls, name: str, tokens: int, count: int, device: torch.device, seed: int
    ) -> ChunkCopies:
        per_chunk = tokens // BLOCK_TOKENS
        caches = Caches.random(MODELS[name], 2 * count * per_chunk + 1, device, seed)
        chunk_format = caches.chunk_format(tokens)
        blocks = scattered_blocks(caches.num_blocks, 2 * count * per_chunk, seed)
        runs = [blocks[k * per_chunk : (k + 1) * per_chunk] for k in range(2 * count)]
        copier = BlockCopier(caches.block_views, chunk_format)
        return cls(caches, chunk_format, copier, runs[:count], runs[count:])

    def store(self, chunks: Sequence[torch.Tensor]) -> list[Copy]:
        return [
            self.copier.store(chunk, kept_ids(self.format, ids))
            for chunk, ids in zip(chunks, self.sources[: len(chunks)], strict=True)
        ]

    def load(self, chunks: Sequence[torch.Tensor], *, forward_reads: bool = True) -> list[Copy]:
        return [
            self.copier.load(
                chunk,
                [(0, ids) for ids in kept_ids(self.format, target)],
                forward_reads=forward_reads,
            )
            for chunk, target in zip(chunks, self.targets[: len(chunks)], strict=True)
        ]

    def clear_targets(self) -> None:
        """Zero the blocks loads write, so a check after a load sees only what it wrote."""
        for views, kept in zip(
            self.caches.block_views,
            zip(*(kept_ids(self.format, target) for target in self.targets), strict=True),
            strict=True,
        ):
            blocks = [block for ids in kept for block in ids]
            for view in views:
                view[blocks] = 0

    def check(self, what: str) -> None:
        check_round_trip(self.caches, self.format, self.sources, self.targets, what)


def reserve(
    client: AgentClient, tenant: str, count: int, size: int
) -> tuple[list[bytes], StorePlan]:
    """Reserve ``count`` new chunks of ``size`` bytes through the agent (random keys): the
    keys and the plan, whose lease the caller commits or releases."""
    keys = [os.urandom(32) for _ in range(count)]
    plan = client.prepare_store(tenant, keys, [size] * count)
    if plan.lease is None or len(plan.offsets) != count or min(plan.offsets) < 0:
        raise SystemExit(f"the agent reserved {plan.offsets} of {count} chunks: {plan.refused}")
    return keys, plan
