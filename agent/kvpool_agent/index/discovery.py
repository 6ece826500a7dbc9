"""Where the pool's agents are: a static list, or the pool's agent pods in Kubernetes.

A discovery calls ``on_change`` with the complete list of agents whenever it
changes (:meth:`~kvpool_agent.index.subscriber.EventSubscriber.follow` takes
it as is). One agent per node: the node name identifies it, in the tracker
and in routing answers.

:class:`KubernetesDiscovery` lists and then watches the pods labelled
``app.kubernetes.io/component=agent,kvpool.io/pool=<pool>`` in one namespace
(it needs ``get``, ``list`` and ``watch`` on pods there). A pod counts while
it is running, has an IP and is not being deleted; its endpoints are
``tcp://<pod IP>:<port>`` for the container ports named ``zmq`` and
``events`` (7400 and 7402 when not named). Where two pods sit on one node (a
surge during a rollout), the newer one wins. The ``kubernetes`` package is
imported only when this discovery is used (by name: it may come with or
without type information).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import urllib3

log = logging.getLogger(__name__)

DEFAULT_ZMQ_PORT = 7400
DEFAULT_EVENTS_PORT = 7402
COMPONENT_LABEL = "app.kubernetes.io/component"
POOL_LABEL = "kvpool.io/pool"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True, order=True)
class AgentEndpoint:
    node: str
    zmq: str
    """The agent's ZMQ protocol endpoint (snapshots), e.g. ``tcp://10.0.0.5:7400``."""
    events: str
    """Its chunk-event PUB endpoint, e.g. ``tcp://10.0.0.5:7402``."""

    @classmethod
    def parse(cls, text: str) -> AgentEndpoint:
        """``NODE=ZMQ_ENDPOINT,EVENTS_ENDPOINT``, as ``kvpool index --agent`` takes it."""
        node, _, endpoints = text.partition("=")
        zmq_endpoint, _, events = endpoints.partition(",")
        if not node or not zmq_endpoint or not events or "," in events:
            raise ValueError(
                f"expected NODE=ZMQ_ENDPOINT,EVENTS_ENDPOINT "
                f"(e.g. gpu-1=tcp://10.0.0.5:7400,tcp://10.0.0.5:7402), got {text!r}"
            )
        return cls(node, zmq_endpoint, events)


EndpointsListener = Callable[[list[AgentEndpoint]], None]
"""Receives every agent of the pool, each time the set changes."""


class Discovery(Protocol):
    def start(self, on_change: EndpointsListener) -> None: ...

    def stop(self) -> None: ...


class StaticDiscovery:
    """A fixed list of agents (local use, tests)."""

    def __init__(self, endpoints: Iterable[AgentEndpoint]) -> None:
        self.endpoints = sorted(endpoints)

    def start(self, on_change: EndpointsListener) -> None:
        on_change(list(self.endpoints))

    def stop(self) -> None:
        """Nothing runs in the background."""


def label_selector(pool: str) -> str:
    return f"{COMPONENT_LABEL}=agent,{POOL_LABEL}={pool}"


def pod_endpoint(pod: Mapping[str, Any]) -> AgentEndpoint | None:
    """The endpoints of one agent pod (the API's JSON form), or None while it does not count."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    ip, node = status.get("podIP"), spec.get("nodeName")
    if status.get("phase") != "Running" or not ip or not node or metadata.get("deletionTimestamp"):
        return None
    ports = {
        port.get("name"): port.get("containerPort")
        for container in spec.get("containers") or []
        for port in container.get("ports") or []
    }
    host = f"[{ip}]" if ":" in ip else ip
    return AgentEndpoint(
        node,
        f"tcp://{host}:{ports.get('zmq') or DEFAULT_ZMQ_PORT}",
        f"tcp://{host}:{ports.get('events') or DEFAULT_EVENTS_PORT}",
    )


def endpoints_of(pods: Iterable[Mapping[str, Any]]) -> list[AgentEndpoint]:
    """One endpoint per node, from the newest pod that counts there."""
    newest = sorted(pods, key=lambda pod: (pod.get("metadata") or {}).get("creationTimestamp", ""))
    by_node = {
        endpoint.node: endpoint
        for endpoint in (pod_endpoint(pod) for pod in newest)
        if endpoint is not None
    }
    return sorted(by_node.values())


class KubernetesDiscovery:
    def __init__(
        self,
        list_pods: Callable[..., Any],
        namespace: str,
        pool: str,
        *,
        timeout: float = 10.0,
        retry_seconds: float = 2.0,
        watch_seconds: int = 300,
    ) -> None:
        """``list_pods`` is ``CoreV1Api.list_namespaced_pod`` (or a stand-in with its
        signature, called with ``_preload_content=False``)."""
        self.namespace = namespace
        self.pool = pool
        self._list_pods = list_pods
        self._timeout = timeout
        self._retry_seconds = retry_seconds
        self._watch_seconds = watch_seconds
        self._pods: dict[str, Mapping[str, Any]] = {}
        self._published: list[AgentEndpoint] | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def connect(cls, pool: str, namespace: str | None = None) -> KubernetesDiscovery:
        """Through this pod's service account (in a pod) or the kubeconfig (elsewhere);
        ``namespace`` defaults to this pod's own."""
        kube_config: Any = importlib.import_module("kubernetes.config")
        kube_client: Any = importlib.import_module("kubernetes.client")
        configuration = kube_client.Configuration()
        try:
            if "KUBERNETES_SERVICE_HOST" in os.environ:
                kube_config.load_incluster_config(client_configuration=configuration)
            else:
                kube_config.load_kube_config(client_configuration=configuration)
        except kube_config.ConfigException as error:
            raise ValueError(f"no Kubernetes API to discover agents with: {error}") from error
        if namespace is None:
            try:
                namespace = NAMESPACE_FILE.read_text().strip()
            except OSError as error:
                raise ValueError(
                    f"no namespace configured and {NAMESPACE_FILE} is unreadable "
                    f"({error.strerror}): set the index's namespace"
                ) from error
        api = kube_client.CoreV1Api(kube_client.ApiClient(configuration))
        return cls(api.list_namespaced_pod, namespace, pool)

    @property
    def where(self) -> str:
        return f"pods {label_selector(self.pool)} in namespace {self.namespace}"

    def start(self, on_change: EndpointsListener) -> None:
        """List and watch the agent pods; ``on_change`` runs in the watch thread."""
        self._thread = threading.Thread(
            target=self._watch, args=(on_change,), name="kvpool-index-discovery", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            response = self._response
        if response is not None:
            response.shutdown()  # wakes the watch thread from its blocking read
        if self._thread is not None:
            self._thread.join(self._timeout)

    def _watch(self, on_change: EndpointsListener) -> None:
        import urllib3

        api_exception = importlib.import_module("kubernetes.client.exceptions").ApiException
        while not self._stopping.is_set():
            try:
                self._follow(self._list(on_change), on_change)
            except (api_exception, urllib3.exceptions.HTTPError, OSError, ValueError) as error:
                if self._stopping.is_set():
                    return
                log.warning(
                    "watching %s failed (%s); retrying in %ss",
                    self.where,
                    error,
                    self._retry_seconds,
                )
                self._stopping.wait(self._retry_seconds)

    def _list(self, on_change: EndpointsListener) -> str:
        """Publish the agents now; returns the resourceVersion to watch from."""
        response = self._list_pods(
            self.namespace,
            label_selector=label_selector(self.pool),
            _preload_content=False,
            _request_timeout=self._timeout,
        )
        listed: dict[str, Any] = json.loads(response.data)
        self._pods = {
            (pod.get("metadata") or {}).get("name", ""): pod for pod in listed.get("items") or []
        }
        self._publish(on_change)
        return str((listed.get("metadata") or {}).get("resourceVersion") or "")

    def _follow(self, version: str, on_change: EndpointsListener) -> None:
        """Publish every change after ``version`` until the server ends the watch."""
        response: urllib3.BaseHTTPResponse = self._list_pods(
            self.namespace,
            label_selector=label_selector(self.pool),
            watch=True,
            resource_version=version,
            timeout_seconds=self._watch_seconds,
            _preload_content=False,
            _request_timeout=(self._timeout, self._watch_seconds + self._timeout),
        )
        with self._lock:
            self._response = response
        try:
            if self._stopping.is_set():
                return
            for line in response:
                event: dict[str, Any] = json.loads(line)
                kind, pod = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if pod.get("code") == 410:
                        return  # our resourceVersion is too old: list again
                    raise ValueError(f"watch error: {pod.get('message')}")
                name = (pod.get("metadata") or {}).get("name", "")
                if kind in ("ADDED", "MODIFIED"):
                    self._pods[name] = pod
                elif kind == "DELETED":
                    self._pods.pop(name, None)
                self._publish(on_change)
        finally:
            with self._lock:
                self._response = None
            response.release_conn()

    def _publish(self, on_change: EndpointsListener) -> None:
        endpoints = endpoints_of(self._pods.values())
        if endpoints != self._published:
            self._published = endpoints
            log.info("agents of pool %s: %s", self.pool, ", ".join(e.node for e in endpoints))
            on_change(endpoints)
