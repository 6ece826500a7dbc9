"""Prefill on one host, decode on another, through the endpoint picker and real Envoy.

Two hosts (network namespaces), each with an agent whose peer is the other's, built by
``kvpool bench cluster``'s own :class:`~kvpool.tools.bench.cluster.cluster.Cluster`: host
A runs a vLLM CPU server as ``kv_producer``, host B one as ``kv_consumer`` behind the P/D
sidecar; the index's picker (roles, a 512-token threshold, the pool's disaggregation key)
and Envoy run in this machine's namespace. A long prompt through Envoy is split: the
picker names A for the prefill in a signed header and routes to B; B's sidecar sends A the
prefill, A's agent offers the prompt to B's agent, which pulls it, and B's decode loads
all but the last token and generates.

The reference for every comparison is B's own vLLM computing the prompt from scratch (a
salt nothing is stored under; B never stores). Outputs are compared up to noise
(:mod:`tests.support.greedy`), with a poisoned-cache control beside.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import httpx
import pytest

from kvpool.common.disagg import DecodeParams, PrefillParams
from kvpool.tools.bench.cluster.cluster import MODEL, Cluster, Flavor, Server, Settings
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN, AgentProcess
from kvpool.tools.bench.local.models import write_model
from tests.support.completions import Completion, complete
from tests.support.engines import poison_segment
from tests.support.hosts import hosts_or_skip
from tests.support.metrics import metric, stays_in_the_pick
from tests.support.polling import eventually

pytest.importorskip("vllm")

pytestmark = [
    pytest.mark.process,
    pytest.mark.engine,
    pytest.mark.root,
    pytest.mark.netns,
    pytest.mark.timeout(900),
]

CHUNK = 256
PROMPT = 7 * CHUNK + 208  # seven full chunks and a tail: past the picker's 512 tokens
WAIT_MS = 3000
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass(frozen=True)
class Pair:
    cluster: Cluster
    prefill: Server
    decode: Server

    @property
    def decode_agent(self) -> AgentProcess:
        return self.cluster.agents[1]

    def reference(self, tokens: list[int]) -> Completion:
        """The decode server computing ``tokens`` from scratch."""
        done = complete(self.decode.vllm_url, MODEL, tokens, "pd-reference", log_tail=self.logs)
        assert done.cached == 0
        return done

    def logs(self) -> str:
        servers = (self.prefill, self.decode)
        tails = [server.process.log_tail(30) for server in servers]
        if self.decode.sidecar is not None:
            tails.append(self.decode.sidecar.log_tail(30))
        if self.cluster.index is not None:
            tails.append("".join(self.cluster.index.log[-30:]))
        return "\n----\n".join(tails)

    def offers(self) -> str:
        """What each agent says of the offers it sent and received, and of its prefetches."""
        wanted = ("kvpool_peer_offers_", "kvpool_prefetch_", "kvpool_peer_fetch")
        lines = []
        for host, agent in enumerate(self.cluster.agents):
            samples = httpx.get(f"{agent.http}/metrics", timeout=10).text.splitlines()
            lines += [f"host {host}: {s}" for s in samples if s.startswith(wanted)]
        return "\n".join(lines)

    def picker_sees_both_ready(self) -> None:
        """The picker sees both servers ready, neither about to drop out."""
        assert self.cluster.index is not None
        for server in (self.prefill, self.decode):
            assert stays_in_the_pick(self.cluster.index.url, server.address), server.address


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(PROMPT)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    work = tmp_path_factory.mktemp("disaggregation")
    with hosts_or_skip(1):  # this machine can make hosts (the cluster makes its own)
        pass
    settings = Settings(
        servers_per_host=1,
        vllm_blocks=64,
        l1_size="256Mi",
        max_model_len=4096,
        max_num_seqs=4,
        lmcache_python=None,
        decode_wait_ms=WAIT_MS,
    )
    model = write_model(work / "model")
    with (
        Cluster(work, settings, model, {}, {}) as cluster,
        cluster.servers(Flavor.DISAGG) as servers,
    ):
        prefill, decode = servers
        assert (prefill.role, decode.role) == ("prefill", "decode")
        made = Pair(cluster, prefill, decode)
        eventually(lambda: _picked(made), timeout=60, what="the picker routing through Envoy")
        yield made


def _picked(pair: Pair) -> None:
    """A short prompt goes through Envoy whole, to the decode server, by the picker."""
    done = complete(pair.cluster.picker_url, MODEL, prompt(0)[:64], "warm-up", max_tokens=1)
    assert done.headers.get("x-kvpool-pick", "fail_open").split(";")[0] != "fail_open"


def test_a_long_prompt_is_prefilled_on_one_host_and_decoded_on_the_other(pair: Pair) -> None:
    tokens = prompt(1)
    reference = pair.reference(tokens)
    offers = metric(pair.decode_agent, 'kvpool_peer_offers_received_total{outcome="accepted"}')
    pulled = metric(pair.decode_agent, 'kvpool_peer_fetched_chunks_total{peer="host-0"}')

    done = complete(pair.cluster.picker_url, MODEL, tokens, "team-a", log_tail=pair.logs)

    pick, sidecar = done.headers["x-kvpool-pick"], done.headers["x-kvpool-pd"]
    assert pick.startswith(f"pd; prefill={pair.prefill.address};"), pick
    assert "status=ok" in sidecar, sidecar
    assert done.cached == PROMPT - 1, pair.logs()
    assert not done.result.differences(reference.result)
    # the prompt came from host A's agent, offered to host B's: seven chunks and the tail
    assert (
        metric(pair.decode_agent, 'kvpool_peer_offers_received_total{outcome="accepted"}')
        == offers + 1
    )
    assert (
        metric(pair.decode_agent, 'kvpool_peer_fetched_chunks_total{peer="host-0"}') == pulled + 8
    )


def test_a_short_prompt_is_served_whole_by_the_decode_host(pair: Pair) -> None:
    done = complete(pair.cluster.picker_url, MODEL, prompt(2)[:300], "team-a")
    assert not done.headers["x-kvpool-pick"].startswith("pd"), done.headers["x-kvpool-pick"]
    assert "status=passthrough" in done.headers["x-kvpool-pd"]


def test_a_poisoned_pushed_prompt_fails_the_comparison(pair: Pair) -> None:
    """Negative control: the decode computes with the bytes that were pushed to its host."""
    tokens = prompt(3)
    reference = pair.reference(tokens)
    agent = pair.decode_agent
    landed = metric(agent, "kvpool_prefetch_loaded_chunks_total")
    _push(pair, tokens)
    try:
        eventually(
            lambda: _at_least(agent, "kvpool_prefetch_loaded_chunks_total", landed + 8),
            what="the pushed prompt on the decode host",
        )
    except AssertionError as error:
        raise AssertionError(f"{error}\n{pair.offers()}\n{pair.logs()}") from error
    poison_segment(agent.segment_path)
    try:
        params = DecodeParams(PROMPT, tail=True, node=pair.prefill.node, wait_ms=WAIT_MS)
        poisoned = complete(pair.decode.vllm_url, MODEL, tokens, "team-a", params=params.to_json())
    finally:
        httpx.post(f"{agent.http}/v1/clear", headers=ADMIN, timeout=30).raise_for_status()
    assert poisoned.cached == PROMPT - 1, pair.logs()
    assert poisoned.result.differences(reference.result)


def _push(pair: Pair, tokens: list[int], tries: int = 3) -> None:
    """Prefill ``tokens`` on host A, pushed to host B, until A's agent says B accepted the
    offer. An offer is best effort (one that finds B busy, or fails on a loaded machine, is
    not sent again: B's own lookup pulls instead); the push itself is proven by the test of
    the long prompt, and this control only needs the pushed bytes there."""
    accepted = 'kvpool_peer_offers_sent_total{outcome="accepted"}'
    prefill_agent = pair.cluster.agents[0]
    for _ in range(tries):
        before = metric(prefill_agent, accepted)
        prefilled = complete(
            pair.prefill.url,
            MODEL,
            tokens,
            "team-a",
            params=PrefillParams(push_to=pair.decode.node).to_json(),
            max_tokens=1,
            log_tail=pair.logs,
        )
        assert prefilled.reply["kv_transfer_params"] == DecodeParams(PROMPT, tail=True).to_json()
        try:
            eventually(partial(_at_least, prefill_agent, accepted, before + 1), timeout=10)
            return
        except AssertionError:
            continue
    raise AssertionError(f"no offer accepted in {tries} pushes\n{pair.offers()}")


def _at_least(agent: AgentProcess, name: str, value: float) -> None:
    assert metric(agent, name) >= value


def test_a_stalled_push_costs_the_decode_its_wait_never_the_answer(pair: Pair) -> None:
    """The decode host's link crawls (8 Mbit/s: the prompt's 8 MiB take about 8 s): the
    decode waits its deadline, loads the whole chunks that arrived, and computes the rest."""
    tokens = prompt(5)
    eventually(pair.picker_sees_both_ready, timeout=30, what="the picker reading both loads")
    with pair.cluster.hosts[1].throttled("8mbit"):
        done = complete(pair.cluster.picker_url, MODEL, tokens, "team-c", log_tail=pair.logs)
    reference = pair.reference(tokens)  # after: a decode server busy with it could read unready
    assert done.headers["x-kvpool-pick"].startswith("pd"), done.headers["x-kvpool-pick"]
    assert "status=ok" in done.headers["x-kvpool-pd"], done.headers["x-kvpool-pd"]
    assert done.cached % CHUNK == 0 and done.cached < PROMPT - 1, pair.logs()
    assert not done.result.differences(reference.result)
    assert done.result.seconds < WAIT_MS / 1000 + 30


def test_a_prefill_host_killed_mid_request_still_yields_the_right_answer(pair: Pair) -> None:
    """Last: the prefill server is frozen once it has the request, then killed; the sidecar
    falls back to computing the prompt on the decode host, within its deadline.

    The picker must see both servers ready when it picks: a decode server whose loads it
    cannot read (busy with a reference on a loaded machine) would leave the frozen prefill
    server the only ready one, which takes the request whole (the pool still serves), and
    dies with it. So the reference is computed afterwards, on an idle decode server."""
    tokens = prompt(4)
    eventually(pair.picker_sees_both_ready, timeout=30, what="the picker reading both loads")
    group = pair.prefill.process.pid
    os.killpg(group, signal.SIGSTOP)
    answers: list[Completion] = []
    client = threading.Thread(
        target=lambda: answers.append(
            complete(pair.cluster.picker_url, MODEL, tokens, "team-b", log_tail=pair.logs)
        )
    )
    started = time.monotonic()
    client.start()
    time.sleep(2.0)  # the sidecar has sent the prefill: it waits on the frozen server
    os.killpg(group, signal.SIGKILL)
    client.join(120)
    assert answers, "no answer"
    (done,) = answers
    reference = pair.reference(tokens)
    assert done.headers["x-kvpool-pick"].startswith("pd"), done.headers["x-kvpool-pick"]
    assert "status=fallback" in done.headers["x-kvpool-pd"], done.headers["x-kvpool-pd"]
    assert done.cached % CHUNK == 0  # what the prefill committed before it died, or nothing
    assert not done.result.differences(reference.result)
    assert time.monotonic() - started < 60
