"""How a chunk is cut into slabs for the GPU copies, and the block ids they take (the slab
copies themselves need CUDA: ``test_worker_cuda.py``, ``test_fused.py``)."""

from __future__ import annotations

import pytest
import torch

from kvpool.connector.layout import BlockLayout, ChunkFormat, GroupRule
from kvpool.connector.staged import block_index, slabs

PAGE = (2, 16, 8, 128)
"""A FlashAttention block of Llama-3-8B: 64 KiB in bf16."""


def layouts(count: int) -> list[BlockLayout]:
    layout = BlockLayout(100, 1, 1, PAGE, torch.bfloat16, "dBd2d3d4", False, False)
    return [layout] * count


def test_slabs_are_runs_of_whole_layers_that_cover_the_chunk_in_order() -> None:
    full, window = GroupRule("full", 16), GroupRule("window", 16, 1023)
    chunk_format = ChunkFormat.of([(full, layouts(8)), (window, layouts(40))], 2048, "FA")
    layer = [group.kept * group.page_bytes for group in chunk_format.groups]
    assert layer == [128 << 16, 64 << 16]  # 8 MiB and 4 MiB

    cut = slabs(chunk_format, 32 << 20)

    assert [(slab.group, len(slab.layers)) for slab in cut] == [(0, 4), (0, 4)] + [(1, 8)] * 5
    offset = 0
    for slab in cut:
        assert slab.offset == offset and slab.size == len(slab.layers) * layer[slab.group]
        assert slab.size <= 32 << 20
        offset += slab.size
    assert offset == chunk_format.chunk_bytes
    assert [list(slab.layers) for slab in cut[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_layer_larger_than_a_slab_is_a_slab_of_its_own() -> None:
    chunk_format = ChunkFormat.of([(GroupRule("full", 16), layouts(3))], 2048, "FA")

    cut = slabs(chunk_format, 1 << 20)

    assert [list(slab.layers) for slab in cut] == [[0], [1], [2]]
    assert [slab.size for slab in cut] == [8 << 20] * 3


def test_block_ids_outside_the_cache_are_refused_before_any_copy() -> None:
    cpu = torch.device("cpu")

    assert block_index([0, 96, 5], 97, cpu).tolist() == [0, 96, 5]
    with pytest.raises(ValueError, match=r"block ids \[97, -1\] outside the cache's 97 blocks"):
        block_index([3, 97, -1], 97, cpu)
