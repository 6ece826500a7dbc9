"""Layout detection by shape and stride, and the copy primitive on CPU."""

from __future__ import annotations

import pytest
import torch

from kvpool.connector.copier import BlockCopier
from kvpool.connector.layout import ChunkFormat, GroupRule, LayoutError, detect_layout

BLOCKS, HEADS, TOKENS, CONTENT = 12, 4, 16, 8  # logical [B, H, N, C] per layer
FULL = GroupRule("full", TOKENS)


def standard(order: str, generator: torch.Generator) -> torch.Tensor:
    """A ``[B, H, N, C]`` view whose memory is laid out in ``order`` (e.g. ``"BNHC"``)."""
    sizes = {"B": BLOCKS, "H": HEADS, "N": TOKENS, "C": CONTENT}
    base = torch.randn(*(sizes[name] for name in order), generator=generator)
    return base.to(torch.bfloat16).permute(*(order.index(name) for name in "BHNC"))


@pytest.mark.parametrize(
    ("order", "page_contiguous", "blocks_adjacent"),
    [("BHNC", True, True), ("BNHC", False, False), ("HBNC", False, False)],
)
def test_standard_views_in_any_physical_order(
    order: str, page_contiguous: bool, blocks_adjacent: bool
) -> None:
    tensor = standard(order, torch.Generator().manual_seed(0))
    layout = detect_layout(tensor, BLOCKS)
    assert layout.block_dim == 0
    assert layout.split == 1
    assert layout.page_shape == (HEADS, TOKENS, CONTENT)
    assert layout.physical_order == order
    assert (layout.page_contiguous, layout.blocks_adjacent) == (page_contiguous, blocks_adjacent)
    assert layout.page_bytes == HEADS * TOKENS * CONTENT * 2


def test_layers_interleaved_per_block() -> None:
    base = torch.zeros(BLOCKS, 3, HEADS, TOKENS, CONTENT)  # [B, L, H, N, C]
    layout = detect_layout(base[:, 1], BLOCKS)
    assert layout.page_contiguous and not layout.blocks_adjacent
    assert layout.physical_order == "BHNC"


def test_kernel_blocks_are_grouped_into_manager_blocks() -> None:
    tensor = torch.zeros(BLOCKS * 2, HEADS, TOKENS // 2, CONTENT)
    layout = detect_layout(tensor, BLOCKS)
    assert layout.split == 2
    assert layout.page_shape == (2, HEADS, TOKENS // 2, CONTENT)
    blocks = layout.blocks(tensor)
    blocks[3].fill_(1.0)
    assert tensor[6:8].eq(1.0).all() and tensor.sum() == blocks[3].numel()


def test_a_legacy_kv_split_layout() -> None:
    tensor = torch.zeros(2, BLOCKS, TOKENS, HEADS, CONTENT)  # [2, B, N, H, D]
    layout = detect_layout(tensor, BLOCKS)
    assert layout.block_dim == 1
    assert layout.page_shape == (2, TOKENS, HEADS, CONTENT)
    assert layout.physical_order == "d0Bd2d3d4"


def test_blocks_that_cannot_be_told_apart() -> None:
    with pytest.raises(LayoutError, match="could each hold"):
        detect_layout(torch.zeros(5, BLOCKS, BLOCKS, 4), BLOCKS)
    with pytest.raises(LayoutError, match="no dimension"):
        detect_layout(torch.zeros(5, 7, 4), BLOCKS)


def test_chunk_format() -> None:
    layouts = [detect_layout(standard("BHNC", torch.Generator()), BLOCKS) for _ in range(3)]
    chunk_format = ChunkFormat.of([(FULL, layouts)], chunk_tokens=2 * TOKENS, content="X")
    assert chunk_format.groups[0].blocks_per_chunk == 2
    assert chunk_format.chunk_bytes == 3 * 2 * HEADS * TOKENS * CONTENT * 2
    assert chunk_format.descriptor() == (
        "kvpool-chunk-v1;layer-major;layers=3;blocks=2;page=4x16x8;dtype=bfloat16;content=X"
    )
    with pytest.raises(LayoutError, match="not a multiple"):
        ChunkFormat.of([(FULL, layouts)], chunk_tokens=TOKENS + 1, content="X")
    odd = detect_layout(torch.zeros(BLOCKS, HEADS, TOKENS, CONTENT * 2), BLOCKS)
    with pytest.raises(LayoutError, match="layers differ"):
        ChunkFormat.of([(FULL, [*layouts, odd])], chunk_tokens=TOKENS, content="X")


def caches(order: str, seed: int, layers: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [standard(order, generator) for _ in range(layers)]


def copier_for(tensors: list[torch.Tensor]) -> tuple[BlockCopier, ChunkFormat]:
    layouts = [detect_layout(tensor, BLOCKS) for tensor in tensors]
    chunk_format = ChunkFormat.of([(FULL, layouts)], chunk_tokens=3 * TOKENS, content="X")
    views = [layout.blocks(tensor) for layout, tensor in zip(layouts, tensors, strict=True)]
    return BlockCopier([views], chunk_format), chunk_format


@pytest.mark.parametrize("source_order", ["BHNC", "BNHC", "HBNC"])
@pytest.mark.parametrize("target_order", ["BHNC", "BNHC"])
def test_a_chunk_moves_between_engines_of_any_physical_layout(
    source_order: str, target_order: str
) -> None:
    source = caches(source_order, seed=1)
    target = [torch.zeros_like(tensor) for tensor in caches(target_order, seed=2)]
    store, chunk_format = copier_for(source)
    load, _ = copier_for(target)
    segment = torch.zeros(chunk_format.chunk_bytes + 64, dtype=torch.uint8)
    chunk = segment[64:]

    assert store.store(chunk, [[5, 0, 9]]).done()
    assert load.load(chunk, [(0, [7, 3, 11])]).done()

    for before, after in zip(source, target, strict=True):
        assert torch.equal(after[[7, 3, 11]], before[[5, 0, 9]])
        untouched = [block for block in range(BLOCKS) if block not in (7, 3, 11)]
        assert not after[untouched].any()
    assert not segment[:64].any()


def test_chunk_bytes_do_not_depend_on_the_physical_layout() -> None:
    standard_cache = caches("BHNC", seed=3)
    permuted = [
        tensor.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for tensor in standard_cache
    ]
    first, chunk_format = copier_for(standard_cache)
    second, _ = copier_for(permuted)
    one = torch.empty(chunk_format.chunk_bytes, dtype=torch.uint8)
    two = torch.empty(chunk_format.chunk_bytes, dtype=torch.uint8)
    first.store(one, [[1, 2, 3]])
    second.store(two, [[1, 2, 3]])
    assert torch.equal(one, two)
    # layer-major, then block, then the page in [H, N, C] order
    expected = torch.cat([tensor[[1, 2, 3]].reshape(-1) for tensor in standard_cache])
    assert torch.equal(one.view(torch.bfloat16), expected)


def test_a_partial_chunk_fills_only_the_missing_blocks() -> None:
    source = caches("BHNC", seed=4)
    target = [torch.zeros_like(tensor) for tensor in source]
    store, chunk_format = copier_for(source)
    load, _ = copier_for(target)
    chunk = torch.empty(chunk_format.chunk_bytes, dtype=torch.uint8)
    store.store(chunk, [[4, 5, 6]])

    load.load(chunk, [(1, [10, 11])])  # vLLM already had the chunk's first block

    for before, after in zip(source, target, strict=True):
        assert torch.equal(after[[10, 11]], before[[5, 6]])
        assert not after[:10].any()
