"""The model servers the endpoint picker chooses among, and how loaded each one is.

**Which servers.** A static list (``picker.servers``: address and node), or the pods that
``picker.selector`` names in one namespace, followed with
:class:`~kvpool.common.kube.watch.ListWatch` like the agents' pods: a pod counts while
:func:`~kvpool.common.kube.pods.placement` says it runs (``Running``, an IP and a node, not
being deleted) *and* its ``Ready`` condition is true (vLLM's readiness probe passes once the
model is loaded); its address is ``podIP:target_port``, its node ``spec.nodeName``.

**Roles** (prefill/decode disaggregation): a static server's ``role``; a pod's label
``kvpool.io/role`` (``prefill``, ``decode``, ``both``) or else llm-d's ``llm-d.ai/role``
(``prefill``, ``decode``, ``prefill-decode`` or ``both``), so that pods deployed for
llm-d's P/D keep their roles. Without either, or with another value (logged, at most once
a minute per pod and value), a server does ``both``: a typo must not take a server out of
every pick.

**Their load.** One background thread reads each server's Prometheus ``/metrics`` every
``load_interval_seconds``, one server after another, each read bounded in time
(``load_timeout_seconds`` for the whole exchange) and size (``max_bytes``): the Gateway
API Inference Extension's model-server protocol gauges as vLLM names them
(``vllm/v1/metrics/loggers.py``): ``vllm:num_requests_waiting``,
``vllm:num_requests_running`` (summed over engines, for a data-parallel server) and
``vllm:kv_cache_usage_perc`` (a fraction, 1 = full; the highest engine's). A new server is
read as soon as it is discovered.

**Readiness.** A server is *ready* while its last read succeeded, or only timed out, at most
:data:`SLOW_READS_KEPT` times in a row since (its last load is kept meanwhile: a vLLM
server's API process, busy streaming tokens, can be slow to answer ``/metrics`` for a
moment, and a pick should not turn away from it, or from everything else, on one slow
read; :attr:`ServerState.slow_reads` counts them). One never read, whose read failed
otherwise (refused, an error status, too large, without the two request gauges), or slow
once more, has no load and is not ready: the picker leaves it out while any other is
ready, and falls back to the known servers by prompt alone when none is (a broken metrics
port must not turn into 503s).
Nothing here blocks a pick: :meth:`ModelServers.snapshot` returns the last published tuple.
"""

from __future__ import annotations

import http.client
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvpool.common.index_config import PickerConfig, ServerRole
from kvpool.common.kube.pods import created, is_ready, namespace_or_own, placement, pod_lister
from kvpool.common.kube.watch import ListWatch
from kvpool.common.names import ROLE_LABEL
from kvpool.common.web.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"

SLOW_READS_KEPT = 2
"""Reads in a row that may time out before a server's last load is dropped (not ready)."""
MAX_REQUESTS = 1e6
"""A gauge above this is taken as this: a confused server must not make the arithmetic
overflow (it is already the least attractive server by far)."""
ROLE_LABELS: tuple[tuple[str, Mapping[str, ServerRole]], ...] = (
    (ROLE_LABEL, {"prefill": "prefill", "decode": "decode", "both": "both"}),
    (
        "llm-d.ai/role",
        {"prefill": "prefill", "decode": "decode", "prefill-decode": "both", "both": "both"},
    ),
)
"""The pod labels that give a server's role, the first one set winning, and their values."""


@dataclass(frozen=True, order=True)
class ServerEndpoint:
    address: str
    """``ip:port`` (``[v6]:port``) of its OpenAI server: what the gateway is told to use."""
    node: str
    """The node it runs on: its agent's node name in the index's trackers."""
    role: ServerRole = "both"
    """What it may be given under prefill/decode disaggregation (see the module's roles)."""


@dataclass(frozen=True)
class Load:
    waiting: float
    """Requests queued, not yet scheduled."""
    running: float
    """Requests in the running batch (prefill or decode)."""
    kv_cache_usage: float
    """Share of its GPU KV cache in use, 0 to 1."""


@dataclass(frozen=True)
class ServerState:
    address: str
    node: str
    load: Load | None = None
    """Its last read load; None: never read, or the last read failed (not ready)."""
    role: ServerRole = "both"
    """Its endpoint's role."""
    slow_reads: int = 0
    """Reads of its /metrics in a row that timed out (its load is kept through
    :data:`SLOW_READS_KEPT` of them)."""

    @property
    def ready(self) -> bool:
        return self.load is not None

    @property
    def decodes(self) -> bool:
        """Whether it may be given whole requests and decodes (role ``decode`` or ``both``)."""
        return self.role != "prefill"

    @property
    def prefills(self) -> bool:
        """Whether it may prefill for another server (role ``prefill`` or ``both``)."""
        return self.role != "decode"


ServersListener = Callable[[list[ServerEndpoint]], None]
"""Receives every model server, each time the set changes."""


class ServerDiscovery(Protocol):
    def start(self, on_change: ServersListener) -> None: ...

    def stop(self) -> None: ...


class StaticServers:
    """A fixed list (``picker.servers``, tests)."""

    def __init__(self, servers: Iterable[ServerEndpoint]) -> None:
        self.servers = sorted(set(servers))

    def start(self, on_change: ServersListener) -> None:
        on_change(list(self.servers))

    def stop(self) -> None:
        """Nothing runs in the background."""


def server_of(pod: Mapping[str, Any], target_port: int) -> ServerEndpoint | None:
    """The model server a pod (the API's JSON form) is, or None while it does not count."""
    where = placement(pod)
    if where is None or not is_ready(pod):
        return None
    return ServerEndpoint(f"{where.host}:{target_port}", where.node, role_of(pod))


def role_of(pod: Mapping[str, Any]) -> ServerRole:
    """The role a pod's labels give it (:data:`ROLE_LABELS`); ``both`` without one, or
    with a value they do not know (logged)."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    for label, roles in ROLE_LABELS:
        value = labels.get(label)
        if value is None:
            continue
        role = roles.get(value)
        if role is None:
            _failures.warning(
                f"model server pod {metadata.get('name')}: {label}={value} is not one of "
                f"{', '.join(roles)}; taken as both"
            )
            return "both"
        return role
    return "both"


def servers_of(pods: Iterable[Mapping[str, Any]], target_port: int) -> list[ServerEndpoint]:
    """The servers of the pods that count, one per address (the newest pod's)."""
    by_address = {
        server.address: server
        for server in (server_of(pod, target_port) for pod in sorted(pods, key=created))
        if server is not None
    }
    return sorted(by_address.values())


def label_selector(labels: Mapping[str, str]) -> str:
    """``k=v,...`` of a selector's labels; ValueError for none (that would be every pod)."""
    if not labels:
        raise ValueError("picker.selector is empty: name the model server pods' labels")
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


class KubernetesServers:
    def __init__(
        self,
        list_pods: Callable[..., Any],
        namespace: str,
        selector: Mapping[str, str],
        target_port: int,
        *,
        timeout: float = 10.0,
        retry_seconds: float = 2.0,
        watch_seconds: int = 300,
    ) -> None:
        """``list_pods`` is ``CoreV1Api.list_namespaced_pod`` (or a stand-in with its
        signature, called with ``_preload_content=False``)."""
        self.target_port = target_port
        self._published: list[ServerEndpoint] | None = None
        labels = label_selector(selector)
        self._pods = ListWatch(
            list_pods,
            namespace,
            selectors={"label_selector": labels},
            what=f"model server pods {labels} in namespace {namespace}",
            timeout=timeout,
            retry_seconds=retry_seconds,
            watch_seconds=watch_seconds,
        )

    @classmethod
    def connect(
        cls, selector: Mapping[str, str], namespace: str | None, target_port: int
    ) -> KubernetesServers:
        """Through this pod's service account (or the kubeconfig); ``namespace`` defaults to
        this pod's own."""
        label_selector(selector)  # refuse an empty selector before reaching for the API
        list_pods = pod_lister("discover model servers with")
        return cls(list_pods, namespace_or_own(namespace, "the index's"), selector, target_port)

    @property
    def where(self) -> str:
        return self._pods.what

    def start(self, on_change: ServersListener) -> None:
        """List and watch the pods; ``on_change`` runs in the watch thread."""
        self._pods.start(
            lambda pods: self._publish(pods.values(), on_change),
            thread_name="kvpool-model-servers",
        )

    def stop(self) -> None:
        self._pods.stop()

    def _publish(self, pods: Iterable[Mapping[str, Any]], on_change: ServersListener) -> None:
        servers = servers_of(pods, self.target_port)
        if servers != self._published:
            self._published = servers
            log.info("model servers: %s", ", ".join(s.address for s in servers) or "none")
            on_change(servers)


def discovery_of(config: PickerConfig, namespace: str | None) -> ServerDiscovery:
    """The discovery ``config`` asks for (``namespace``: the index's, for kubernetes)."""
    if config.discovery == "kubernetes":
        return KubernetesServers.connect(config.selector, namespace, config.target_port)
    return StaticServers(ServerEndpoint(s.address, s.node, s.role) for s in config.servers)


# ------------------------------------------------------------------------------ load


def parse_load(text: str) -> Load:
    """The load in a Prometheus text exposition; ValueError without the request gauges or
    with a value that is not a number >= 0."""
    found: dict[str, list[float]] = {WAITING: [], RUNNING: [], KV_CACHE_USAGE: []}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):  # name{labels} value [timestamp]
            name, rest = line[:brace], line[line.rfind("}") + 1 :] if "}" in line else ""
        else:  # name value [timestamp]
            name, _, rest = line.partition(" ")
        values = found.get(name)
        if values is None:
            continue
        fields = rest.split()
        value = float(fields[0]) if fields else math.nan
        if not value >= 0:  # NaN too
            raise ValueError(f"{name} is {fields[0] if fields else 'missing'}")
        values.append(value)
    for name in (WAITING, RUNNING):
        if not found[name]:
            raise ValueError(f"no {name} gauge")
    usage = found[KV_CACHE_USAGE]
    return Load(
        min(sum(found[WAITING]), MAX_REQUESTS),
        min(sum(found[RUNNING]), MAX_REQUESTS),
        min(max(usage, default=0.0), 1.0),
    )


def read_load(address: str, timeout: float, max_bytes: int) -> Load:
    """GET ``http://address/metrics`` within ``timeout`` seconds in all and ``max_bytes``;
    OSError, HTTPException or ValueError when that fails."""
    deadline = time.monotonic() + timeout
    connection = http.client.HTTPConnection(address, timeout=timeout)
    try:
        connection.request("GET", "/metrics", headers={"Accept": "text/plain"})
        response = connection.getresponse()
        if response.status != 200:
            raise ValueError(f"answered {response.status} {response.reason}")
        body = bytearray()
        while chunk := response.read1(65536):
            body += chunk
            if len(body) > max_bytes:
                raise ValueError(f"/metrics is larger than {max_bytes} bytes")
            if time.monotonic() > deadline:
                raise TimeoutError(f"/metrics took more than {timeout}s")
        return parse_load(body.decode("utf-8", "replace"))
    finally:
        connection.close()


class ModelServers:
    """The servers a discovery names, with their loads, read in one background thread."""

    def __init__(
        self,
        discovery: ServerDiscovery,
        *,
        interval: float,
        timeout: float,
        max_bytes: int = 4 << 20,
        on_change: ServersListener | None = None,
    ) -> None:
        """``timeout`` bounds one server's read; ``max_bytes`` its /metrics (vLLM's is
        tens of kilobytes); ``on_change`` hears every set of servers discovery finds."""
        self.interval = interval
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._discovery = discovery
        self._on_change = on_change
        self._lock = threading.Lock()
        self._states: dict[str, ServerState] = {}
        self._published: tuple[ServerState, ...] = ()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def of_config(
        cls,
        config: PickerConfig,
        namespace: str | None,
        on_change: ServersListener | None = None,
    ) -> ModelServers:
        return cls(
            discovery_of(config, namespace),
            interval=config.load_interval_seconds,
            timeout=config.load_timeout_seconds,
            on_change=on_change,
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvpool-server-loads", daemon=True)
        self._thread.start()
        self._discovery.start(self._discovered)

    def stop(self) -> None:
        self._discovery.stop()
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def snapshot(self) -> tuple[ServerState, ...]:
        """Every known server and its last load, by address; never blocks."""
        return self._published

    def _discovered(self, servers: Sequence[ServerEndpoint]) -> None:
        with self._lock:
            previous = self._states
            self._states = {
                s.address: replace(previous[s.address], node=s.node, role=s.role)
                if s.address in previous
                else ServerState(s.address, s.node, role=s.role)
                for s in servers
            }
            self._publish()
        self._wake.set()  # read the new ones now
        if self._on_change is not None:
            self._on_change(list(servers))

    def _publish(self) -> None:
        self._published = tuple(self._states[a] for a in sorted(self._states))

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            for server in self._published:
                if self._stopping.is_set():
                    return
                self._read(server)
            self._wake.wait(self.interval)

    def _read(self, server: ServerState) -> None:
        """Read ``server``'s load and publish it (its last one, after a slow read kept)."""
        address, load, slow = server.address, server.load, 0
        try:
            load = read_load(address, self.timeout, self.max_bytes)
        except TimeoutError as error:
            slow = server.slow_reads + 1
            kept = slow <= SLOW_READS_KEPT
            said = "its last load kept" if kept else "not ready"
            _failures.warning(f"model server {address}: /metrics slow ({error}); {said}")
            if not kept:
                load = None
        except (OSError, http.client.HTTPException, ValueError) as error:
            _failures.warning(f"model server {address}: no load from /metrics: {error}")
            load = None
        with self._lock:
            state = self._states.get(address)
            if state is not None:
                self._states[address] = replace(state, load=load, slow_reads=slow)
                self._publish()
