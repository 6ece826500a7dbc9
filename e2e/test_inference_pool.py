"""The inference gateway's example (``crds/examples/inference-gateway/``): ``kubectl apply``
to the emulated API server, with the Gateway API Inference Extension's InferencePool CRD
(v1.5.0, ``tests/support/gaie/``), admits the pool and the InferencePool; InferencePools
that break the CRD are refused with its messages; and the InferencePool names what the
operator renders for the pool: the index Service's picker port (HTTP/2), the picker's
model servers (selector, target port)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.scenario import Unavailable, kubectl_binary
from kvpool.operator.render import PICKER_PORT_NAME, Pool, render
from kvpool.operator.spec import PoolSpec
from tests.support.crd_schema import GAIE_CRD_PATH
from tests.support.kube_api import ServedApi

pytestmark = pytest.mark.process

REPO = Path(__file__).parents[1]
EXAMPLE = REPO / "crds" / "examples" / "inference-gateway"
NAMESPACE = "inference"


def _load(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((EXAMPLE / name).read_text())
    return loaded


@pytest.fixture(scope="module")
def kubectl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``kubectl`` against an emulated API server with kvpool's CRDs and the InferencePool
    CRD, and the namespace of the example."""
    try:
        binary = kubectl_binary()
    except Unavailable as error:
        pytest.skip(str(error))
    api = ServedApi(tmp_path_factory.mktemp("api")).start()
    config = api.kubeconfig()

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(binary), "--kubeconfig", str(config), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    namespace = yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    )
    for args, stdin in (
        (("apply", "--validate=false", "-f", str(REPO / "crds")), None),
        (("apply", "--validate=false", "-f", str(GAIE_CRD_PATH)), None),
        (("apply", "--validate=false", "-f", "-"), namespace),
    ):
        done = run(*args, stdin=stdin)
        assert done.returncode == 0, done.stderr
    yield run
    api.stop()


def test_the_example_is_applied_and_the_inferencepool_accepted(kubectl: Any) -> None:
    done = kubectl("apply", "--validate=false", "-n", NAMESPACE, "-f", str(EXAMPLE))
    assert done.returncode == 0, done.stderr
    assert "inferencepool.inference.networking.k8s.io/qwen3 created" in done.stdout
    stored = yaml.safe_load(
        kubectl("get", "-n", NAMESPACE, "infpool", "qwen3", "-o", "yaml").stdout
    )
    assert stored["spec"] == _load("inferencepool.yaml")["spec"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"targetPorts": [{"number": 8000}, {"number": 8000}]}, "port number must be unique"),
        (
            {"endpointPickerRef": {"name": "kvpool-main-index"}},
            "port is required when kind is 'Service'",
        ),
        ({"selector": {"matchLabels": {}}}, "spec.selector.matchLabels"),
        ({"endpointPickerRef": {**{"name": "x", "port": {"number": 70000}}}}, "70000"),
        (
            {"endpointPickerRef": {"name": "x", "port": {"number": 1}, "failureMode": "Maybe"}},
            "'Maybe' is not one of",
        ),
    ],
)
def test_an_invalid_inferencepool_is_refused_with_the_crds_message(
    kubectl: Any, change: dict[str, Any], message: str
) -> None:
    pool = _load("inferencepool.yaml")
    pool["metadata"]["name"] = "broken"
    pool["spec"] |= change
    done = kubectl(
        "apply", "--validate=false", "-n", NAMESPACE, "-f", "-", stdin=yaml.safe_dump(pool)
    )
    assert done.returncode != 0
    assert 'InferencePool.inference.networking.k8s.io "broken" is invalid' in done.stderr
    assert message in done.stderr, done.stderr
    assert kubectl("get", "-n", NAMESPACE, "infpool", "broken").returncode != 0


def test_the_inferencepool_names_the_picker_the_operator_renders() -> None:
    pool, inference_pool = _load("pool.yaml"), _load("inferencepool.yaml")
    spec = PoolSpec.parse(pool["spec"])
    children = render(Pool(pool["metadata"]["name"], NAMESPACE, "u"), spec, default_image="i")
    assert children.index is not None
    service = children.index.service
    ref = inference_pool["spec"]["endpointPickerRef"]
    assert (ref.get("group", ""), ref["kind"]) == ("", "Service")
    assert ref["name"] == service["metadata"]["name"]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert (port["targetPort"], port["appProtocol"]) == (PICKER_PORT_NAME, "kubernetes.io/h2c")
    picker = spec.index.picker
    assert inference_pool["spec"]["selector"]["matchLabels"] == picker.selector
    assert inference_pool["spec"]["targetPorts"][0]["number"] == picker.target_port
