"""The Kubernetes quota store against the emulated API server: durable writes that never
clobber another agent's tenants, a watch that brings every change to every store, and
last-known quotas while the API server is unreachable."""

from __future__ import annotations

import json
import logging
import queue
import time
from collections.abc import Iterator

import pytest
from kubernetes import config as kube_config
from kubernetes.client import CoreV1Api

from kvpool.agent.tenancy.kube_quota_store import KubernetesQuotaStore
from kvpool.agent.tenancy.quota_store import QuotaStoreError
from kvpool.common.keys import tenant_id
from kvpool.common.quotas import Limit
from tests.support.kube_api import Proxy, ServedApi
from tests.support.operator_process import Kubectl

pytestmark = pytest.mark.process

NAMESPACE = "quotas"
NAME = "kvpool-main-quotas"
ALICE = tenant_id("alice")
BOB = tenant_id("bob")
Quotas = dict[str, Limit]


@pytest.fixture
def config_map(kubectl: Kubectl) -> Iterator[str]:
    """The pool's quota ConfigMap, as the operator makes it (no data)."""
    manifest = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": NAME}}
    kubectl("apply", "--validate=false", "-n", NAMESPACE, "-f", "-", manifest=manifest)
    yield NAME
    kubectl("delete", "configmap", NAME, "-n", NAMESPACE, "--ignore-not-found")


class Stores:
    """Stores against the API server (or a proxy in front of it), stopped after the test."""

    def __init__(self, served_api: ServedApi) -> None:
        self._served_api = served_api
        self._made: list[KubernetesQuotaStore] = []

    def __call__(self, url: str | None = None, watch_seconds: int = 300) -> KubernetesQuotaStore:
        kubeconfig = self._served_api.kubeconfig(url, f"kubeconfig-{len(self._made)}")
        api = CoreV1Api(kube_config.new_client_from_config(str(kubeconfig)))
        store = KubernetesQuotaStore(
            api, NAMESPACE, NAME, timeout=2.0, retry_seconds=0.1, watch_seconds=watch_seconds
        )
        self._made.append(store)
        return store

    def stop(self) -> None:
        for store in self._made:
            store.stop()


@pytest.fixture
def stores(served_api: ServedApi) -> Iterator[Stores]:
    made = Stores(served_api)
    yield made
    made.stop()


@pytest.fixture
def store(stores: Stores) -> KubernetesQuotaStore:
    return stores()


@pytest.fixture
def other_store(stores: Stores) -> KubernetesQuotaStore:
    return stores()


@pytest.fixture
def proxy(served_api: ServedApi) -> Proxy:
    return served_api.proxy()


def _data(served_api: ServedApi) -> dict[str, str] | None:
    found = served_api.objects("configmaps", NAMESPACE).get(NAME)
    return None if found is None else found.get("data", {})


class Changes:
    """What a store's watch reported, in order."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Quotas] = queue.Queue()

    def __call__(self, quotas: Quotas) -> None:
        self._queue.put(quotas)

    def next(self, timeout: float = 5.0) -> Quotas:
        return self._queue.get(timeout=timeout)

    def wait_for(self, expected: Quotas, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                seen.append(self.next(max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                break
            if seen[-1] == expected:
                return
        raise AssertionError(f"never saw {expected}; saw {seen}")

    def none(self, within: float = 0.5) -> bool:
        try:
            self._queue.get(timeout=within)
        except queue.Empty:
            return True
        return False


def test_round_trip(store: KubernetesQuotaStore, config_map: str, served_api: ServedApi) -> None:
    assert store.load() == {}
    store.save(ALICE, 1 << 20)
    store.save(BOB, None)
    store.save(ALICE, 0)
    assert store.load() == {ALICE: 0, BOB: None}
    assert _data(served_api) == {ALICE: "0", BOB: "unlimited"}
    store.delete(BOB)
    store.delete(BOB)  # deleting twice is a no-op
    assert store.load() == {ALICE: 0}
    assert _data(served_api) == {ALICE: "0"}


def test_writers_through_different_agents_keep_each_others_tenants(
    store: KubernetesQuotaStore, other_store: KubernetesQuotaStore, config_map: str
) -> None:
    store.load()
    other_store.load()  # both read the same (empty) quotas, then write different tenants
    store.save(ALICE, 4096)
    other_store.save(BOB, 8192)
    assert store.load() == other_store.load() == {ALICE: 4096, BOB: 8192}


def test_every_store_sees_every_change(
    store: KubernetesQuotaStore,
    other_store: KubernetesQuotaStore,
    config_map: str,
    kubectl: Kubectl,
) -> None:
    changes = Changes()
    assert other_store.load() == {}
    other_store.start(changes)
    assert changes.none(), "an unchanged ConfigMap reports nothing"
    store.save(ALICE, 4096)
    assert changes.next() == {ALICE: 4096}
    store.save(BOB, None)
    assert changes.next() == {ALICE: 4096, BOB: None}
    store.delete(ALICE)
    assert changes.next() == {BOB: None}
    patch = json.dumps({"data": {ALICE: "123"}})
    kubectl("patch", "configmap", NAME, "-n", NAMESPACE, "--type=merge", "-p", patch)
    assert changes.next() == {ALICE: 123, BOB: None}  # an admin's edit applies too
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "unrelated"}}
    kubectl("apply", "--validate=false", "-n", NAMESPACE, "-f", "-", manifest=other)
    assert changes.none(), "only the quota ConfigMap is watched"
    assert other_store.load() == {ALICE: 123, BOB: None}


def test_the_watch_outlives_the_servers_watch_timeout(
    stores: Stores, store: KubernetesQuotaStore, config_map: str
) -> None:
    watching = stores(watch_seconds=1)
    changes = Changes()
    watching.start(changes)
    assert changes.next() == {}
    time.sleep(2.5)  # the server has ended the watch twice by now
    store.save(ALICE, 1)
    assert changes.next() == {ALICE: 1}


def test_a_deleted_configmap_means_no_quotas(
    store: KubernetesQuotaStore, config_map: str, kubectl: Kubectl
) -> None:
    store.save(ALICE, 1)
    changes = Changes()
    store.start(changes)
    assert changes.next() == {ALICE: 1}
    kubectl("delete", "configmap", NAME, "-n", NAMESPACE)
    assert changes.next() == {}
    assert store.load() == {}
    with pytest.raises(QuotaStoreError, match="does not exist"):
        store.save(ALICE, 2)


def test_values_that_are_no_quota_are_ignored(
    store: KubernetesQuotaStore,
    config_map: str,
    kubectl: Kubectl,
    caplog: pytest.LogCaptureFixture,
) -> None:
    patch = json.dumps({"data": {ALICE: "lots", BOB: "12"}})
    kubectl("patch", "configmap", NAME, "-n", NAMESPACE, "--type=merge", "-p", patch)
    with caplog.at_level(logging.ERROR):
        assert store.load() == {BOB: 12}
    assert f"the quota of tenant {ALICE} is 'lots'" in caplog.text


def test_last_known_quotas_while_the_api_server_is_unreachable(
    served_api: ServedApi,
    stores: Stores,
    store: KubernetesQuotaStore,
    config_map: str,
    proxy: Proxy,
) -> None:
    distant = stores(proxy.url)
    store.save(ALICE, 1)
    assert distant.load() == {ALICE: 1}
    changes = Changes()
    distant.start(changes)

    served_api.call(proxy.cut())
    assert distant.load() == {ALICE: 1}
    with pytest.raises(QuotaStoreError, match="unreachable"):
        distant.save(BOB, 2)
    store.save(BOB, 3)  # through another agent, while this one cannot see it
    assert changes.none(within=0.5)

    served_api.call(proxy.open())
    changes.wait_for({ALICE: 1, BOB: 3})
    assert distant.load() == {ALICE: 1, BOB: 3}


def test_without_any_known_quotas_an_unreachable_server_is_an_error(
    served_api: ServedApi, stores: Stores, config_map: str, proxy: Proxy
) -> None:
    served_api.call(proxy.cut())
    distant = stores(proxy.url)
    with pytest.raises(
        QuotaStoreError, match=f"cannot read quotas from ConfigMap {NAMESPACE}/{NAME}"
    ):
        distant.load()


def test_stop_ends_the_watch_at_once(store: KubernetesQuotaStore, config_map: str) -> None:
    changes = Changes()
    store.start(changes)
    assert changes.next() == {}
    started = time.monotonic()
    store.stop()
    assert time.monotonic() - started < 1.0


def test_connect_through_the_kubeconfig(
    served_api: ServedApi, config_map: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(served_api.kubeconfig()))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    store = KubernetesQuotaStore.connect(f"{NAMESPACE}/{NAME}")
    store.save(ALICE, 7)
    assert (store.namespace, store.name, store.load()) == (NAMESPACE, NAME, {ALICE: 7})
    with pytest.raises(ValueError, match="namespace/name"):
        KubernetesQuotaStore.connect(NAME)
    monkeypatch.setenv("KUBECONFIG", str(served_api.workdir / "absent"))
    with pytest.raises(QuotaStoreError, match="no access to the Kubernetes API"):
        KubernetesQuotaStore.connect(f"{NAMESPACE}/{NAME}")
