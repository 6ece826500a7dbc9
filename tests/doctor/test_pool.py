"""``kvpool doctor --pool``: the discovery checks through the emulated API server, with the
Service and the index ConfigMap the operator renders, and each failure they name (a
missing RBAC grant, a protocol mismatch, a missing Service, a broken annotation), and the
fingerprint check against the index's configuration.

The agent itself is out of reach here (the Service's name resolves only in a cluster);
``e2e`` runs the doctor in a pod, where every check passes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kvpool.common.protocol import PROTOCOL_VERSION
from kvpool.operator.render import Pool, render
from kvpool.operator.spec import PoolSpec
from tests.support.kube_api import ServedApi

from .conftest import run_doctor

pytestmark = pytest.mark.process

NAMESPACE = "inference"
POOL = Pool("main", NAMESPACE, "0f1e2d3c-0000-4000-8000-000000000000")
FINGERPRINT = {"model": "org/model@rev", "dtype": "bfloat16", "kvLayout": "kvpool-chunk-v1;x"}
ENGINE = ["--model", "org/model@rev", "--dtype", "bfloat16", "--kv-layout", "kvpool-chunk-v1;x"]
VLLM_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:vllm"


SPEC = PoolSpec.parse(
    {
        "chunkTokens": 256,
        "tenants": {"tokensSecretRef": {"name": "kvpool-main-tokens"}},
        "index": {"enabled": True, "fingerprint": FINGERPRINT},
    }
)


@pytest.fixture(scope="module")
def namespace(served_api: ServedApi) -> Any:
    core = served_api.core_api()
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    return core


@pytest.fixture
def pool(served_api: ServedApi, namespace: Any) -> Iterator[dict[str, Any]]:
    """The pool's Service and index ConfigMap, as the operator renders them."""
    children = render(POOL, SPEC, default_image="kvpool:test")
    assert children.index is not None
    namespace.create_namespaced_service(NAMESPACE, children.service)
    namespace.create_namespaced_config_map(NAMESPACE, children.index.config)
    yield children.service
    namespace.delete_namespaced_service(POOL.service_name, NAMESPACE)
    with contextlib.suppress(ApiException):  # a test may have deleted it
        namespace.delete_namespaced_config_map(POOL.index_config_name, NAMESPACE)


def doctor(served_api: ServedApi, *args: str) -> Any:
    env = {"KUBECONFIG": str(served_api.kubeconfig())}
    return run_doctor("--pool", "main", "--namespace", NAMESPACE, "--timeout", "1", *args, env=env)


def test_discovery_and_the_fingerprint_through_the_pools_objects(
    served_api: ServedApi, pool: dict[str, Any]
) -> None:
    diagnosis = doctor(served_api, *ENGINE)

    checks = diagnosis.checks
    assert checks["service"].outcome == "PASS", diagnosis.output
    assert checks["service"].seen == f"read Service {NAMESPACE}/kvpool-main with the kubeconfig"
    assert checks["protocol"].seen == (
        f"the Service and this client speak protocol {PROTOCOL_VERSION}"
    )
    assert checks["annotations"].seen == (
        "zmq tcp://kvpool-main.inference.svc:7400, http http://kvpool-main.inference.svc:7401, "
        "segment /dev/shm/kvpool-main/segment, chunk tokens 256"
    )
    assert checks["fingerprint"].outcome == "PASS", diagnosis.output
    assert '"chunk_tokens": 256' in checks["fingerprint"].seen
    # outside the cluster the Service's name does not resolve: the agent check says so
    assert checks["agent"].outcome == "FAIL"
    assert "the name kvpool-main.inference.svc does not resolve" in checks["agent"].seen
    for name in ("door", "transport", "canary"):
        assert (checks[name].outcome, checks[name].seen) == ("SKIP", "needs an agent that answers")


def test_missing_rbac_grant(served_api: ServedApi, pool: dict[str, Any]) -> None:
    with served_api.deny("test", VLLM_ACCOUNT, "get", "services"):
        diagnosis = doctor(served_api)

    assert diagnosis.returncode == 1
    failure = diagnosis.checks["service"]
    assert failure.outcome == "FAIL"
    assert failure.seen == (
        f"this pod may not get Service {NAMESPACE}/kvpool-main (the kubeconfig): "
        f'services "kvpool-main" is forbidden: User "{VLLM_ACCOUNT}" cannot get resource '
        f'"services" in API group "" in the namespace "{NAMESPACE}"'
    )
    assert failure.fix == (
        f"kubectl -n {NAMESPACE} create role kvpool-main-discovery --verb=get "
        f"--resource=services --resource-name=kvpool-main && kubectl -n {NAMESPACE} create "
        f"rolebinding kvpool-main-discovery --role=kvpool-main-discovery "
        f"--serviceaccount={NAMESPACE}:vllm"
    )
    skipped = {
        name: line.seen
        for name, line in diagnosis.checks.items()
        if name not in ("service", "model")  # the model check needs no agent: no --model-config
    }
    assert set(skipped.values()) == {
        "needs the Service",
        "needs the agent's address (discovery failed)",
    }, diagnosis.output
    # the grant is all it lacked: another token (another account) reads the Service
    assert doctor(served_api).checks["service"].outcome == "PASS"


def test_protocol_mismatch_in_the_service(
    served_api: ServedApi, namespace: Any, pool: dict[str, Any]
) -> None:
    other = PROTOCOL_VERSION + 1
    annotations = {"kvpool.io/protocol-version": str(other)}
    namespace.patch_namespaced_service(
        POOL.service_name, NAMESPACE, {"metadata": {"annotations": annotations}}
    )

    diagnosis = doctor(served_api)

    assert diagnosis.returncode == 1
    assert diagnosis.checks["service"].outcome == "PASS"
    failure = diagnosis.checks["protocol"]
    assert failure.outcome == "FAIL"
    assert failure.seen == (
        f"Service {NAMESPACE}/kvpool-main speaks protocol {other}; "
        f"this connector speaks {PROTOCOL_VERSION}"
    )
    assert failure.fix is not None and "one kvpool release" in failure.fix
    assert diagnosis.checks["annotations"].seen == "needs a protocol this client speaks"
    assert diagnosis.checks["agent"].outcome == "SKIP"


def test_broken_annotation(served_api: ServedApi, namespace: Any, pool: dict[str, Any]) -> None:
    namespace.patch_namespaced_service(
        POOL.service_name, NAMESPACE, {"metadata": {"annotations": {"kvpool.io/zmq-port": "zmq"}}}
    )

    diagnosis = doctor(served_api)

    assert diagnosis.checks["protocol"].outcome == "PASS"
    failure = diagnosis.checks["annotations"]
    assert failure.outcome == "FAIL"
    assert failure.seen == "Service kvpool-main: kvpool.io/zmq-port='zmq' is not an integer"
    assert diagnosis.checks["agent"].outcome == "SKIP"


def test_no_such_pool(served_api: ServedApi, pool: dict[str, Any]) -> None:
    env = {"KUBECONFIG": str(served_api.kubeconfig())}
    diagnosis = run_doctor("--pool", "other", "--namespace", NAMESPACE, env=env)

    failure = diagnosis.checks["service"]
    assert (failure.outcome, failure.seen) == ("FAIL", f"no Service {NAMESPACE}/kvpool-other")
    assert failure.fix is not None and "kubectl get kvp -A" in failure.fix


def test_fingerprint_mismatch(served_api: ServedApi, pool: dict[str, Any]) -> None:
    engine = [
        "--model",
        "org/other-model",
        "--dtype",
        "bfloat16",
        "--kv-layout",
        "kvpool-chunk-v1;x",
    ]

    diagnosis = doctor(served_api, *engine)

    failure = diagnosis.checks["fingerprint"]
    assert failure.outcome == "FAIL", diagnosis.output
    assert failure.seen == (
        f"the index ({NAMESPACE}/kvpool-main-index-config) hashes prompts for another engine: "
        "model: index 'org/model@rev', connector 'org/other-model'"
    )
    patch = {
        "spec": {
            "index": {
                "fingerprint": {
                    "model": "org/other-model",
                    "dtype": "bfloat16",
                    "kvLayout": "kvpool-chunk-v1;x",
                    "tpRank": 0,
                    "tpSize": 1,
                    "chunkTokens": 256,
                }
            }
        }
    }
    assert failure.fix == (
        f"kubectl -n {NAMESPACE} patch kvp main --type=merge -p '{json.dumps(patch)}'"
    )


def test_fingerprint_skipped_without_an_index_or_a_model(
    served_api: ServedApi, namespace: Any, pool: dict[str, Any]
) -> None:
    assert doctor(served_api).checks["fingerprint"].seen == (
        "no --model, --dtype, --kv-layout given (the connector logs them at start)"
    )
    namespace.delete_namespaced_config_map(POOL.index_config_name, NAMESPACE)
    no_index = doctor(served_api, *ENGINE).checks["fingerprint"]
    assert (no_index.outcome, no_index.seen) == (
        "SKIP",
        f"the pool has no index (no ConfigMap {NAMESPACE}/kvpool-main-index-config)",
    )
