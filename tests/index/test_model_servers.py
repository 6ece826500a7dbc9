"""Model servers: their pods, their /metrics over real HTTP, and the background reader.

Each model server is a real HTTP server on 127.0.0.1 whose /metrics is what vLLM's
Prometheus logger exposes for the three gauges (``prometheus_client``, the names and
labels of ``vllm/v1/metrics/loggers.py``); the Kubernetes API is the stand-in of
``test_discovery``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.common.index_config import ModelServer, PickerConfig
from kvpool.common.kube import pods
from kvpool.index.model_servers import (
    SLOW_READS_KEPT,
    KubernetesServers,
    Load,
    ModelServers,
    ServerEndpoint,
    StaticServers,
    discovery_of,
    parse_load,
    read_load,
    server_of,
    servers_of,
)
from tests.index.test_discovery import PodApi, pod
from tests.support.polling import wait_until
from tests.support.vllm_metrics import MetricsServer, vllm_metrics


@pytest.fixture
def metrics_servers() -> Iterator[list[MetricsServer]]:
    made = [MetricsServer() for _ in range(2)]
    yield made
    for server in made:
        server.close()


# -------------------------------------------------------------------------- parsing


def test_vllm_metrics_give_the_load_summed_over_engines() -> None:
    text = vllm_metrics([(3, 5, 0.25), (1, 2, 0.75)]).decode()
    assert parse_load(text) == Load(waiting=4, running=7, kv_cache_usage=0.75)
    no_usage = "vllm:num_requests_waiting 2\nvllm:num_requests_running 1 1700000000000\n"
    assert parse_load(no_usage) == Load(2, 1, 0.0)
    assert parse_load("vllm:num_requests_waiting 1e300\nvllm:num_requests_running 0\n") == Load(
        1e6, 0, 0
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "no vllm:num_requests_waiting gauge"),
        ("vllm:num_requests_waiting 1\n", "no vllm:num_requests_running gauge"),
        ("vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n", "waiting is NaN"),
        ("vllm:num_requests_waiting -1\nvllm:num_requests_running 1\n", "waiting is -1"),
        ("vllm:num_requests_waiting\nvllm:num_requests_running 1\n", "waiting is missing"),
        ("vllm:num_requests_waiting x\n", "could not convert"),
        ('vllm:num_requests_waiting{engine="0" 1\nvllm:num_requests_running 1\n', "missing"),
    ],
)
def test_metrics_without_a_usable_load_are_refused(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_load(text)


# ---------------------------------------------------------------------------- reading


def test_a_load_is_read_over_http(metrics_servers: list[MetricsServer]) -> None:
    served = metrics_servers[0]
    served.body = vllm_metrics([(2, 8, 0.5)])
    assert read_load(served.address, timeout=2, max_bytes=1 << 20) == Load(2, 8, 0.5)


def test_a_bad_answer_is_an_error_not_a_load(metrics_servers: list[MetricsServer]) -> None:
    served = metrics_servers[0]
    served.status = 500
    with pytest.raises(ValueError, match="answered 500"):
        read_load(served.address, timeout=2, max_bytes=1 << 20)
    served.status = 200
    served.body = b"# HELP x\n" + b"x 1\n" * 100_000
    with pytest.raises(ValueError, match="larger than 65536 bytes"):
        read_load(served.address, timeout=2, max_bytes=65536)
    served.close()
    with pytest.raises(OSError):
        read_load(served.address, timeout=2, max_bytes=1 << 20)


def test_a_slow_server_is_given_up_on_in_bounded_time(metrics_servers: list[MetricsServer]) -> None:
    served = metrics_servers[0]
    served.drip = 0.05  # each byte in time, the whole body far too late
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"more than 0\.3s"):
        read_load(served.address, timeout=0.3, max_bytes=1 << 20)
    assert time.monotonic() - started < 1.0


# ----------------------------------------------------------------- background reader


def test_servers_are_ready_while_their_metrics_answer(metrics_servers: list[MetricsServer]) -> None:
    good, bad = metrics_servers
    good.body = vllm_metrics([(1, 2, 0.1)])
    bad.status = 503
    servers = ModelServers(
        StaticServers([ServerEndpoint(good.address, "n1"), ServerEndpoint(bad.address, "n2")]),
        interval=0.05,
        timeout=1.0,
    )
    servers.start()
    try:
        wait_until(lambda: bad.reads and any(s.ready for s in servers.snapshot()))
        states = {s.address: s for s in servers.snapshot()}
        assert states[good.address].load == Load(1, 2, 0.1)
        assert states[good.address].ready and not states[bad.address].ready
        assert states[bad.address].node == "n2"
        good.status = 500  # fails: not ready, at the next read
        bad.status = 200  # recovers
        wait_until(lambda: {s.address for s in servers.snapshot() if s.ready} == {bad.address})
    finally:
        servers.stop()


def test_a_slow_read_keeps_the_last_load_a_while_and_then_not_ready(
    metrics_servers: list[MetricsServer],
) -> None:
    """A busy vLLM can be slow to answer /metrics: its last load is kept through
    SLOW_READS_KEPT slow reads in a row, not one more; a fast read makes it ready again.
    The slow reads in a row are published with the state."""
    served, _ = metrics_servers
    served.body = vllm_metrics([(3, 1, 0.2)])
    servers = ModelServers(
        StaticServers([ServerEndpoint(served.address, "n1")]), interval=0.01, timeout=0.5
    )
    servers.start()
    try:
        wait_until(lambda: all(s.ready for s in servers.snapshot()))
        before = served.reads
        served.drip = 0.01  # the whole body takes seconds: every read times out (0.5 s)
        counted = set()
        while served.reads < before + SLOW_READS_KEPT + 1:  # the last kept one may run
            state = servers.snapshot()[0]
            assert state.load == Load(3, 1, 0.2)
            counted.add(state.slow_reads)
            time.sleep(0.005)
        assert servers.snapshot()[0].ready  # the next slow read has only begun
        counted.add(servers.snapshot()[0].slow_reads)
        assert counted == set(range(SLOW_READS_KEPT + 1))
        wait_until(lambda: not servers.snapshot()[0].ready)
        assert served.reads >= before + SLOW_READS_KEPT + 1
        assert servers.snapshot()[0].slow_reads == SLOW_READS_KEPT + 1
        served.drip = 0.0
        wait_until(lambda: servers.snapshot()[0].load == Load(3, 1, 0.2))
        assert servers.snapshot()[0].slow_reads == 0
    finally:
        servers.stop()


def test_a_new_server_is_read_at_once_and_a_gone_one_forgotten(
    metrics_servers: list[MetricsServer],
) -> None:
    first, second = metrics_servers

    class Changing:
        def start(self, on_change: Any) -> None:
            self.on_change = on_change
            on_change([ServerEndpoint(first.address, "n1")])

        def stop(self) -> None:
            """Nothing runs."""

    discovery = Changing()
    # only a change can cause a second read
    servers = ModelServers(discovery, interval=60, timeout=1.0)
    servers.start()
    try:
        wait_until(lambda: all(s.ready for s in servers.snapshot()))
        discovery.on_change([ServerEndpoint(second.address, "n2")])
        wait_until(lambda: [s.ready for s in servers.snapshot()] == [True])
        assert [s.address for s in servers.snapshot()] == [second.address]
    finally:
        servers.stop()


# -------------------------------------------------------------------------------- pods


def model_pod(name: str, *, ready: bool = True, **options: Any) -> dict[str, Any]:
    made = pod(name, ports={"http": 8000}, **options)
    made["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return made


def test_only_running_ready_pods_are_servers() -> None:
    assert server_of(model_pod("a"), 8000) == ServerEndpoint("10.0.0.5:8000", "gpu-1")
    assert server_of(model_pod("a", ip="fd00::7"), 9000) == ServerEndpoint(
        "[fd00::7]:9000", "gpu-1"
    )
    for waiting in (
        model_pod("a", ready=False),
        model_pod("a", phase="Pending"),
        model_pod("a", deleting=True),
        model_pod("a", node=None),
        pod("a"),  # no conditions yet
    ):
        assert server_of(waiting, 8000) is None
    two_on_a_node = [model_pod("a", ip="10.0.0.1"), model_pod("b", ip="10.0.0.2")]
    assert [s.address for s in servers_of(two_on_a_node, 8000)] == [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
    ]


def test_kubernetes_servers_follow_the_selected_pods() -> None:
    api = PodApi()
    api.pods = [model_pod("a", ready=False)]
    seen: list[list[ServerEndpoint]] = []
    discovery = KubernetesServers(api, "ml", {"app": "vllm", "pool": "p1"}, 8000)
    discovery.start(seen.append)
    try:
        watch = api.watches.get(timeout=5)
        assert api.calls[0]["label_selector"] == "app=vllm,pool=p1"
        assert api.calls[0]["namespace"] == "ml"
        watch.push("MODIFIED", model_pod("a"))
        wait_until(lambda: seen == [[], [ServerEndpoint("10.0.0.5:8000", "gpu-1")]])
        watch.push("DELETED", model_pod("a"))
        wait_until(lambda: len(seen) == 3)
        assert seen[-1] == []
    finally:
        discovery.stop()


def test_a_kubernetes_discovery_needs_a_selector_and_a_namespace(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    with pytest.raises(ValueError, match=r"picker\.selector is empty"):
        discovery_of(PickerConfig(discovery="kubernetes"), "ml")
    monkeypatch.setattr(pods, "NAMESPACE_FILE", tmp_path / "absent")
    with pytest.raises(ValueError, match="set the index's namespace"):
        pods.namespace_or_own(None, "the index's")
    static = discovery_of(
        PickerConfig(servers=[ModelServer(address="10.0.0.1:8000", node="n1")]), None
    )
    assert isinstance(static, StaticServers)
    assert static.servers == [ServerEndpoint("10.0.0.1:8000", "n1")]
    configured = ModelServers.of_config(
        PickerConfig(load_interval_seconds=2, load_timeout_seconds=3), None
    )
    assert (configured.interval, configured.timeout) == (2, 3)
