"""The fused copies (:mod:`kvpool.connector.fused`): one launch moves a slab's blocks of every
layer, byte for byte as the per-layer path (``index_select``, ``index_copy_``) moves them, for
every KV cache layout the connector takes.

On CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``): the same kernel code,
each program run by numpy, so its indexing is checked on any machine. On a CUDA device it runs
compiled, through :class:`~kvpool.connector.staged.StagedCopies`, against its per-layer path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kvpool.connector import fused
from kvpool.connector.fused import FusedPages, runs_of
from kvpool.connector.layout import ChunkFormat, GroupRule, detect_layout
from kvpool.connector.staged import StagedCopies
from kvpool.tools.bench.gpu_caches import MODELS

pytest.importorskip("triton")

BLOCKS = 9
LAYERS = 3


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of random bits (no value compares unequal to itself: bytes are compared)."""
    generator = torch.Generator().manual_seed(seed)
    count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return bits.view(dtype).view(shape)


def _permuted(shape: tuple[int, ...], order: tuple[int, ...]) -> Callable[[int], torch.Tensor]:
    """Layers of logical ``shape`` laid out in memory in dimension ``order`` (an HND cache)."""
    physical = tuple(shape[dim] for dim in order)
    back = tuple(order.index(dim) for dim in range(len(order)))
    return lambda seed: _random(physical, torch.bfloat16, seed).permute(*back)


def _plain(shape: tuple[int, ...], dtype: torch.dtype) -> Callable[[int], torch.Tensor]:
    return lambda seed: _random(shape, dtype, seed)


def _model(name: str) -> Callable[[int], torch.Tensor]:
    model = MODELS[name]
    return _plain(model.layer_shape(BLOCKS), model.dtype)


LAYOUTS: dict[str, Callable[[int], torch.Tensor]] = {
    "llama3-8b (FlashAttention [2,B,16,8,128])": _model("llama3-8b"),
    "small-heads (FlashAttention [2,B,16,2,64])": _model("small-heads"),
    "mla (latent [B,16,576])": _model("mla"),
    "gemma3 (FlashAttention [2,B,16,8,256])": _model("gemma3-window"),
    "FlashInfer NHD [B,2,16,2,64]": _plain((BLOCKS, 2, 16, 2, 64), torch.bfloat16),
    "FlashInfer HND [B,2,H,N,D] in memory": _permuted((BLOCKS, 2, 16, 2, 64), (0, 1, 3, 2, 4)),
    "kernel blocks (each block split in 2)": _plain((2, 2 * BLOCKS, 8, 2, 64), torch.bfloat16),
    "fp8 [2,B,16,2,64]": _plain((2, BLOCKS, 16, 2, 64), torch.float8_e4m3fn),
    "odd page (15 elements: two-byte words)": _plain((2, BLOCKS, 5, 1, 3), torch.bfloat16),
    "state record (a Mamba ssm state, fp32)": _plain((BLOCKS, 4, 16, 5), torch.float32),
}


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel made anew under Triton's interpreter (and made anew again after)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused._kernel.cache_clear()
    yield
    fused._kernel.cache_clear()


def _views(make: Callable[[int], torch.Tensor], seed: int) -> list[torch.Tensor]:
    """``LAYERS`` layers as the copier holds them: ``[num_blocks, *page]``."""
    tensors = [make(seed + layer) for layer in range(LAYERS)]
    return [detect_layout(tensor, BLOCKS).blocks(tensor) for tensor in tensors]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(-1)


def _gathered(views: list[torch.Tensor], layers: range, ids: list[int]) -> torch.Tensor:
    """What the per-layer path gathers: each layer's blocks ``ids``, in order."""
    index = torch.tensor(ids)
    return torch.cat([_bytes(torch.index_select(views[layer], 0, index)) for layer in layers])


def _gather(views: list[torch.Tensor], layers: range, ids: list[int]) -> torch.Tensor:
    pages = FusedPages.of(views)
    assert pages is not None
    out = torch.empty(len(_gathered(views, layers, ids)), dtype=torch.uint8)
    pages.gather(layers, torch.tensor(ids), out)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_gather_is_the_per_layer_gather_byte_for_byte(interpreted: None, layout: str) -> None:
    views = _views(LAYOUTS[layout], seed=1)
    layers, ids = range(1, LAYERS), [5, 0, 7, 2]

    assert torch.equal(_gather(views, layers, ids), _gathered(views, layers, ids))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_scatter_writes_what_the_per_layer_scatter_writes_and_nothing_else(
    interpreted: None, layout: str
) -> None:
    """Pages 1 and 2 of a buffer of three a layer go into blocks 4 and 8 of layers 1 and 2;
    every other byte of every layer stays as it was."""
    source = _views(LAYOUTS[layout], seed=2)
    layers, kept = range(1, LAYERS), [3, 6, 1]
    buffer = _gathered(source, range(LAYERS), kept)[len(_gathered(source, range(1), kept)) :]
    fused_views, per_layer = _views(LAYOUTS[layout], seed=3), _views(LAYOUTS[layout], seed=3)
    pages = FusedPages.of(fused_views)
    assert pages is not None

    pages.scatter(layers, torch.tensor([4, 8]), 1, len(kept), buffer)

    for layer in layers:  # as bits: torch has no index_copy_ of fp8 on CPU
        bits = fused.WORDS[per_layer[layer].element_size()]
        moved = source[layer][torch.tensor([6, 1])].view(bits)
        per_layer[layer].view(bits).index_copy_(0, torch.tensor([4, 8]), moved)
    for ours, theirs in zip(fused_views, per_layer, strict=True):
        assert torch.equal(_bytes(ours), _bytes(theirs))
    assert not torch.equal(_bytes(fused_views[1]), _bytes(_views(LAYOUTS[layout], seed=3)[1]))


def test_the_comparison_fails_for_blocks_in_another_order(interpreted: None) -> None:
    """The poisoned case beside the comparisons: the same blocks gathered in another order
    are other bytes."""
    views = _views(LAYOUTS["small-heads (FlashAttention [2,B,16,2,64])"], seed=1)

    assert not torch.equal(
        _gather(views, range(LAYERS), [0, 5, 7, 2]), _gathered(views, range(LAYERS), [5, 0, 7, 2])
    )


def test_pages_are_cut_into_the_longest_runs_and_widest_words() -> None:
    llama = _views(LAYOUTS["llama3-8b (FlashAttention [2,B,16,8,128])"], seed=0)[0]
    hnd = _views(LAYOUTS["FlashInfer HND [B,2,H,N,D] in memory"], seed=0)[0]
    odd = runs_of(_views(LAYOUTS["odd page (15 elements: two-byte words)"], seed=0)[0])

    # K's run and V's run, 32 KiB each, the V run half the cache further on
    assert runs_of(llama) == fused.Runs(
        torch.int64, 4096, ((1, 0), (1, 0), (2, BLOCKS * 4096)), 4096
    )
    # a run per token and head: [2, N, H] around runs of D
    assert runs_of(hnd) == fused.Runs(torch.int64, 1024, ((2, 512), (16, 16), (2, 256)), 16)
    assert odd is not None and (odd.word, odd.run) == (torch.int16, 15)


def test_layers_that_differ_or_pages_of_too_many_runs_are_copied_layer_by_layer() -> None:
    llama = _views(LAYOUTS["llama3-8b (FlashAttention [2,B,16,8,128])"], seed=0)
    hnd = _views(LAYOUTS["FlashInfer HND [B,2,H,N,D] in memory"], seed=0)
    scattered = _random((BLOCKS, 2, 3, 5, 7), torch.bfloat16, 0).permute(0, 4, 3, 2, 1)

    assert FusedPages.of(llama) is not None
    assert FusedPages.of([llama[0], hnd[0]]) is None  # one group's layers share a layout
    assert FusedPages.of([scattered]) is None  # four dimensions around runs of one element
    assert runs_of(scattered) is None


def test_a_page_whose_address_allows_narrower_words_is_copied_in_them() -> None:
    """Layers at 2 and 8 bytes into one buffer: the first moves two-byte words, and the two
    together are no group of one kernel."""
    memory = torch.zeros(2 * 8 + 2 * BLOCKS * 64, dtype=torch.uint8)
    layers = [
        memory[at : at + 2 * BLOCKS * 64].view(torch.bfloat16).view(BLOCKS, 64) for at in (2, 8)
    ]
    runs = [runs_of(layer) for layer in layers]

    assert [None if run is None else run.word for run in runs] == [torch.int16, torch.int64]
    assert FusedPages.of(layers) is None
    assert FusedPages.of(layers[1:]) is not None


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel made anew for the compiler (and made anew again after)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fused._kernel.cache_clear()
    yield
    fused._kernel.cache_clear()


@pytest.mark.process  # Triton runs ptxas
@pytest.mark.parametrize(
    ("word", "gather", "piece", "integers"),
    [("int64", True, 1024, "i32"), ("int16", False, 1, "i64"), ("uint8", True, 16, "i32")],
)
def test_the_kernel_compiles_for_a_hopper_gpu_here(
    compiled: None, word: str, gather: bool, piece: int, integers: str
) -> None:
    """What the interpreter never checks (it ignores the arguments' annotations, say): the
    kernel compiles to a cubin for an H100/H200 (sm_90) with Triton's own compiler and
    ptxas, no GPU needed."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = fused._kernel()
    short = {"int64": "i64", "int16": "i16", "uint8": "u8"}[word]
    pointers = {"bases": "*i64", "ids": "*i64", "buffer": f"*{short}"}
    names = kernel.arg_names[len(pointers) : -3]
    constants = {"WORD": getattr(tl, word), "GATHER": gather, "PIECE": piece}
    signature = {
        **pointers,
        **dict.fromkeys(names, integers),
        **dict.fromkeys(constants, "constexpr"),
    }

    binary = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
    )

    assert binary.asm["cubin"]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_on_cuda_staged_copies_store_and_load_the_per_layer_bytes(
    compiled: None, layout: str
) -> None:
    """A chunk of 4 blocks (a window group keeping its last one) stored and loaded by the fused
    path and by the per-layer path, a slab a layer (slabs from every layer, through both
    staging buffers): the same chunk bytes, the same caches after."""
    make = LAYOUTS[layout]
    tensors = [make(seed).cuda() for seed in range(LAYERS)]
    layouts = [detect_layout(tensor, BLOCKS) for tensor in tensors]
    rules = [GroupRule("full", 16), GroupRule("window", 16, 17)]
    for rule in rules:
        chunk_format = ChunkFormat.of([(rule, layouts)], 4 * 16, "TEST")
        kept = chunk_format.groups[0].kept
        chunks, caches = [], []
        for fused_path in (True, False):
            copies = [tensor.clone() for tensor in tensors]
            views = [layout.blocks(copy) for layout, copy in zip(layouts, copies, strict=True)]
            layer_bytes = chunk_format.chunk_bytes // LAYERS  # a slab a layer: both buffers
            staged = StagedCopies([views], chunk_format, layer_bytes, fused=fused_path)
            assert staged.fused == [fused_path]
            chunk = torch.empty(chunk_format.chunk_bytes, dtype=torch.uint8).pin_memory()
            staged.store(chunk, [[5, 0, 7, 2][-kept:]]).synchronize()
            staged.load(chunk, [(0, [3, 8, 1, 6][-kept:])]).synchronize()
            chunks.append(chunk)
            caches.append([_bytes(copy.cpu()) for copy in copies])
        assert torch.equal(chunks[0], chunks[1])
        for ours, theirs in zip(*caches, strict=True):
            assert torch.equal(ours, theirs)
