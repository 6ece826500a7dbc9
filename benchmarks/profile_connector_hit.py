"""Where the time of a kvpool cache hit goes (issue 18, step 1): one in-process engine.

Runs the ``kvpool bench connector`` model and engine settings in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), wraps the connector's entry points, the
agent client's round trips, the key chains, the copier, vLLM's engine step, scheduler
and model runner with wall-clock timers, and reports per request (median over
``--requests``): the TTFT, where it went, and the ZMQ round trips by kind. Then the
same requests again under cProfile (``--cprofile FILE``) for the function-level view.

    .venv/bin/python benchmarks/profile_connector_hit.py \
        --config kvpool --requests 20 --cprofile /tmp/hit.prof

``--config none`` gives the same figures for the engine without a connector (the
floor: ``--prompt-tokens 128``; the recompute: 2048).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import io
import os
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

TIMES: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
AGENT: dict[str, str] = {"http": ""}
"""The private agent's HTTP address (its /metrics has its own time per operation)."""


def agent_request_seconds() -> dict[str, tuple[float, float]]:
    """The agent's own time serving ZMQ requests, by op: (sum seconds, count)."""
    http = AGENT["http"]
    if not http:
        return {}
    import re
    import urllib.request

    url = http if http.startswith("http") else f"http://{http}"
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found: dict[str, list[float]] = {}
    for match in re.finditer(r'kvpool_request_seconds_(sum|count)\{op="([^"]+)"\} (\S+)', text):
        found.setdefault(match.group(2), [0.0, 0.0])["sc".index(match.group(1)[0])] = float(
            match.group(3)
        )
    return {op: (values[0], values[1]) for op, values in found.items()}


def _wrap(owner: Any, name: str, label: str | None = None, *, key: Any = None) -> None:
    original = getattr(owner, name)
    label = label or f"{owner.__name__}.{name}"

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        tag = label if key is None else f"{label}[{key(*args, **kwargs)}]"
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TIMES[tag] += time.perf_counter() - started
            CALLS[tag] += 1

    setattr(owner, name, timed)


def instrument() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvpool import client
    from kvpool.common import keys
    from kvpool.connector import copier, facade

    _wrap(EngineCore, "step", "vllm EngineCore.step")
    _wrap(Scheduler, "schedule", "vllm Scheduler.schedule")
    _wrap(Scheduler, "update_from_output", "vllm Scheduler.update_from_output")
    _wrap(GPUModelRunner, "execute_model", "vllm ModelRunner.execute_model")
    _wrap(GPUModelRunner, "sample_tokens", "vllm ModelRunner.sample_tokens")
    _wrap(GPUModelRunner, "_model_forward", "vllm ModelRunner._model_forward")
    _wrap(GPUModelRunner, "_prepare_inputs", "vllm ModelRunner._prepare_inputs")
    with contextlib.suppress(ImportError):
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        for name in ("execute_model", "sample_tokens"):
            if name in vars(CPUModelRunner):
                _wrap(CPUModelRunner, name, f"vllm CPUModelRunner.{name}")
    for name in (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "start_load_kv",
        "wait_for_save",
        "get_block_ids_with_load_errors",
        "get_finished",
        "build_connector_worker_meta",
        "get_kv_connector_stats",
    ):
        _wrap(facade.KvpoolConnector, name, f"conn {name}")
    _wrap(
        client.AgentClient,
        "_roundtrip",
        "zmq roundtrip",
        key=lambda self, request, frames=(): type(request).__name__,
    )
    _wrap(keys.KeyChain, "upto", "keys KeyChain.upto")
    _wrap(copier.BlockCopier, "load", "copy BlockCopier.load")
    _wrap(copier.BlockCopier, "store", "copy BlockCopier.store")
    _wrap(copier.MappedSegment, "chunk", "copy MappedSegment.chunk")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="kvpool", choices=("kvpool", "none"))
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cprofile", help="also profile --requests more hits; write stats here")
    parser.add_argument(
        "--vllm-prefix-cache",
        action="store_true",
        help="turn vLLM's own prefix cache on: with --config none, a repeated prompt is the "
        "connector-free floor of a hit (same 128 computed tokens over the same context)",
    )
    parser.add_argument("--floor-tokens", type=int, default=128)
    parser.add_argument("--miss", action="store_true", help="time fresh prompts (0%% hits)")
    args = parser.parse_args()
    model_args = argparse.Namespace(
        layers=args.layers,
        hidden=512,
        heads=8,
        kv_heads=4,
        intermediate=1536,
        prompt_tokens=max(args.prompt_tokens, 2048),
    )
    from kvpool.tools.bench.connector_engine import build_engine, write_model
    from kvpool.tools.bench.local.agent_process import running_agent

    instrument()
    if args.vllm_prefix_cache:
        import vllm

        original = vllm.LLM

        def with_prefix_cache(*a: Any, **kw: Any) -> Any:
            kw["enable_prefix_caching"] = True
            return original(*a, **kw)

        vllm.LLM = with_prefix_cache  # type: ignore[misc]
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-prof-") as work,
        contextlib.ExitStack() as stack,
    ):
        model = Path(work) / "model"
        write_model(model, model_args)
        endpoint = None
        if args.config == "kvpool":
            agent = stack.enter_context(running_agent({"POOL": "bench", "L1_SIZE": "2GiB"}))
            endpoint = agent.zmq
            AGENT["http"] = agent.http
            print(f"agent pid {agent.pid} at {endpoint}", flush=True)
        llm = build_engine(
            {
                "config": args.config,
                "model": str(model),
                "prompt_tokens": max(args.prompt_tokens, 2048),
                "chunk_tokens": 128,
                "endpoint": endpoint,
                "storage": str(Path(work) / "example"),
            }
        )
        run(llm, args, endpoint)


def run(llm: Any, args: argparse.Namespace, endpoint: str | None) -> None:  # noqa: PLR0915
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(1)

    def prompt() -> list[int]:
        return [rng.randrange(3, 8000) for _ in range(args.prompt_tokens)]

    def generate(ids: list[int]) -> tuple[float, int]:
        started = time.perf_counter()
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return time.perf_counter() - started, int(output.num_cached_tokens or 0)

    def floor() -> list[int]:
        return [rng.randrange(3, 8000) for _ in range(args.floor_tokens)]

    for _ in range(3):
        generate(prompt())
        generate(floor())
    shared = prompt()
    generate(shared)
    kinds = {"hit" if not args.miss else "miss": None, f"floor ({args.floor_tokens} tokens)": None}
    paired = args.vllm_prefix_cache and endpoint is not None and not args.miss
    if paired:  # kvpool's hit next to vLLM's own hit on the same prompt, in one engine
        kinds = {"hit": None, "native (vLLM prefix-cache hit)": None, **kinds}
    samples: dict[str, list[tuple[float, float, int, dict[str, float], collections.Counter[str]]]]
    samples = {kind: [] for kind in kinds}
    agent_before = agent_request_seconds()
    for _ in range(args.requests):
        for kind in kinds:  # interleaved: both see the same machine load
            ids = floor() if kind.startswith("floor") else prompt() if args.miss else shared
            if paired and kind == "hit":
                llm.reset_prefix_cache()  # vLLM forgets the prompt: kvpool serves it
            TIMES.clear()
            CALLS.clear()
            cpu = time.process_time()
            seconds, cached = generate(ids)
            cpu = time.process_time() - cpu
            samples[kind].append((seconds, cpu, cached, dict(TIMES), collections.Counter(CALLS)))
    agent_after = agent_request_seconds()
    for op, (after_s, after_n) in sorted(agent_after.items()):
        total = after_s - agent_before.get(op, (0.0, 0.0))[0]
        count = after_n - agent_before.get(op, (0.0, 0.0))[1]
        if count:
            print(f"agent-side {op}: {count:.0f} served, mean {total / count * 1e6:.0f} us")
    for kind, rows in samples.items():
        ttft = statistics.median(row[0] for row in rows)
        print(
            f"\n{args.config} {kind}, {args.layers} layers: TTFT p50 {ttft * 1e3:.2f} ms "
            f"(min {min(r[0] for r in rows) * 1e3:.2f}, max {max(r[0] for r in rows) * 1e3:.2f}), "
            f"process CPU p50 {statistics.median(r[1] for r in rows) * 1e3:.2f} ms, "
            f"cached tokens {statistics.median(r[2] for r in rows):.0f}"
        )
        labels = sorted({label for row in rows for label in row[3]})
        print(f"{f'per request (median of {len(rows)})':<62} {'ms':>8} {'min ms':>8} {'calls':>6}")
        for label in labels:
            values = [row[3].get(label, 0.0) * 1e3 for row in rows]
            calls = statistics.median(row[4].get(label, 0) for row in rows)
            print(f"  {label:<60} {statistics.median(values):8.3f} {min(values):8.3f} {calls:6.0f}")
    if endpoint is not None:
        from kvpool.client import AgentClient
        from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN

        client = AgentClient(endpoint, token=ADMIN_TOKEN, client_name="prof", timeout=5)
        with contextlib.closing(client):
            client.connect()
            rtts = []
            for _ in range(200):
                started = time.perf_counter()
                client.ping()
                rtts.append(time.perf_counter() - started)
        print(f"  agent ping RTT p50 {statistics.median(rtts) * 1e6:.0f} us (this process)")
    if args.cprofile:
        for kind in kinds:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.requests):
                generate(floor() if kind.startswith("floor") else prompt() if args.miss else shared)
            profile.disable()
            path = f"{args.cprofile}.{kind.split()[0]}"
            profile.dump_stats(path)
            out = io.StringIO()
            stats = pstats.Stats(profile, stream=out)
            stats.sort_stats("cumulative").print_stats(30)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats("kvpool", 40)
            print(
                f"\ncProfile of {kind}, {args.requests} requests ({path}; totals, divide by that):"
            )
            print(out.getvalue())


if __name__ == "__main__":
    main()
