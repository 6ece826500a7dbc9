"""Agent discovery: parsing, pods to endpoints, and the Kubernetes list/watch loop.

The Kubernetes API is a stand-in for ``CoreV1Api.list_namespaced_pod`` called
with ``_preload_content=False``: it answers lists with a JSON body and watches
with a stream of JSON lines, as the API server does.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.common.kube.discovery import (
    AgentEndpoint,
    KubernetesDiscovery,
    StaticDiscovery,
    endpoints_of,
    pod_endpoint,
)
from kvpool.common.names import agent_pods_selector
from tests.support.polling import wait_until


def pod(
    name: str,
    *,
    node: str | None = "gpu-1",
    ip: str | None = "10.0.0.5",
    phase: str = "Running",
    created: str = "2030-01-01T00:00:00Z",
    ports: dict[str, int] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "creationTimestamp": created}
    if deleting:
        metadata["deletionTimestamp"] = "2030-01-02T00:00:00Z"
    named = ports if ports is not None else {"zmq": 7400, "http": 7401, "events": 7402}
    return {
        "metadata": metadata,
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "agent",
                    "ports": [{"name": k, "containerPort": v} for k, v in named.items()],
                }
            ],
        },
        "status": {"phase": phase, "podIP": ip},
    }


def test_endpoint_parsing() -> None:
    parsed = AgentEndpoint.parse("gpu-1=tcp://10.0.0.5:7400,tcp://10.0.0.5:7402")
    assert parsed == AgentEndpoint("gpu-1", "tcp://10.0.0.5:7400", "tcp://10.0.0.5:7402")
    for bad in ("gpu-1", "gpu-1=tcp://a:1", "=tcp://a:1,tcp://a:2", "n=a,b,c"):
        with pytest.raises(ValueError, match="NODE=ZMQ_ENDPOINT,EVENTS_ENDPOINT"):
            AgentEndpoint.parse(bad)


def test_static_discovery_reports_its_list_once() -> None:
    seen: list[list[AgentEndpoint]] = []
    endpoints = [AgentEndpoint("b", "z", "e"), AgentEndpoint("a", "z", "e")]
    StaticDiscovery(endpoints).start(seen.append)
    assert seen == [sorted(endpoints)]


def test_pods_become_endpoints_only_while_they_count() -> None:
    assert pod_endpoint(pod("a")) == AgentEndpoint(
        "gpu-1", "tcp://10.0.0.5:7400", "tcp://10.0.0.5:7402", "10.0.0.5:7404"
    )
    custom = pod("a", ports={"zmq": 9000, "events": 9002, "peer": 9004})
    assert pod_endpoint(custom) == AgentEndpoint(
        "gpu-1", "tcp://10.0.0.5:9000", "tcp://10.0.0.5:9002", "10.0.0.5:9004"
    )
    unnamed = pod("a", ip="fd00::7", ports={})
    assert pod_endpoint(unnamed) == AgentEndpoint(
        "gpu-1", "tcp://[fd00::7]:7400", "tcp://[fd00::7]:7402", "[fd00::7]:7404"
    )
    for waiting in (
        pod("a", phase="Pending"),
        pod("a", ip=None),
        pod("a", node=None),
        pod("a", deleting=True),
    ):
        assert pod_endpoint(waiting) is None


def test_the_newest_pod_of_a_node_wins() -> None:
    old = pod("old", ip="10.0.0.1", created="2030-01-01T00:00:00Z")
    new = pod("new", ip="10.0.0.2", created="2030-01-02T00:00:00Z")
    other = pod("other", node="gpu-2", ip="10.0.0.3")
    assert [e.zmq for e in endpoints_of([new, other, old])] == [
        "tcp://10.0.0.2:7400",
        "tcp://10.0.0.3:7400",
    ]
    assert agent_pods_selector("main") == "app.kubernetes.io/component=agent,kvpool.io/pool=main"


class Watch:
    """A watch response: JSON lines pushed by the test, ended by ``end()`` or ``shutdown()``."""

    def __init__(self) -> None:
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.released = False

    def push(self, kind: str, obj: dict[str, Any]) -> None:
        self.lines.put(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    def end(self) -> None:
        self.lines.put(None)

    def shutdown(self) -> None:
        self.end()

    def release_conn(self) -> None:
        self.released = True

    def __iter__(self) -> Iterator[bytes]:
        while (line := self.lines.get()) is not None:
            yield line


class PodApi:
    """Stands in for ``list_namespaced_pod``: lists from ``pods``, watches from the test."""

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.watches: queue.Queue[Watch] = queue.Queue()
        self.fail_next_list = False

    def __call__(self, namespace: str, **options: Any) -> Any:
        self.calls.append({"namespace": namespace, **options})
        assert options["_preload_content"] is False
        if options.get("watch"):
            watch = Watch()
            self.watches.put(watch)
            return watch
        if self.fail_next_list:
            self.fail_next_list = False
            raise OSError("connection refused")
        body = {"metadata": {"resourceVersion": "41"}, "items": self.pods}
        return type("Response", (), {"data": json.dumps(body).encode()})()


@pytest.fixture
def api() -> PodApi:
    return PodApi()


def test_kubernetes_discovery_lists_then_follows_the_pool_pods(api: PodApi) -> None:
    api.pods = [pod("a", node="gpu-1", ip="10.0.0.1")]
    api.fail_next_list = True  # the API server is not there yet: retried
    seen: list[list[str]] = []
    lock = threading.Lock()

    def on_change(endpoints: list[AgentEndpoint]) -> None:
        with lock:
            seen.append([f"{e.node}@{e.zmq}" for e in endpoints])

    discovery = KubernetesDiscovery(api, "kvpool", "main", retry_seconds=0.01)
    discovery.start(on_change)
    try:
        watch = api.watches.get(timeout=5)
        assert seen == [["gpu-1@tcp://10.0.0.1:7400"]]
        first_watch = api.calls[-1]
        assert first_watch["label_selector"] == agent_pods_selector("main")
        assert (first_watch["namespace"], first_watch["resource_version"]) == ("kvpool", "41")

        watch.push("ADDED", pod("b", node="gpu-2", phase="Pending", ip=None))
        watch.push("MODIFIED", pod("b", node="gpu-2", ip="10.0.0.2"))
        wait_until(lambda: len(seen) == 2)
        watch.push("MODIFIED", pod("a", node="gpu-1", ip="10.0.0.1"))  # no change: not reported
        watch.push("DELETED", pod("a", node="gpu-1", ip="10.0.0.1"))
        wait_until(lambda: len(seen) == 3)
        assert seen[1:] == [
            ["gpu-1@tcp://10.0.0.1:7400", "gpu-2@tcp://10.0.0.2:7400"],
            ["gpu-2@tcp://10.0.0.2:7400"],
        ]

        api.pods = [pod("c", node="gpu-3", ip="10.0.0.3")]
        watch.push("ERROR", {"code": 410, "message": "too old resource version"})
        next_watch = api.watches.get(timeout=5)  # listed again, then watched again
        assert watch.released
        wait_until(lambda: seen[-1] == ["gpu-3@tcp://10.0.0.3:7400"], what="the relist")
    finally:
        discovery.stop()
    assert next_watch.released
