"""Every pod spec kvpool renders or documents for tenants passes Pod Security "restricted"
(``tests/support/pod_security.py``), as written and as the admission webhook wires it; and
the checker fails each rule it checks."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.operator.admission.sidecar import DecodeSidecar
from kvpool.operator.admission.wiring import Binding, PoolFacts, apply, wire
from kvpool.operator.render import Pool
from kvpool.operator.spec import PoolSpec
from tests.support.pod_security import restricted

ROOT = Path(__file__).parents[2]
TENANT_DOCUMENTS = (
    ROOT / "README.md",
    ROOT / "crds" / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
)
"""Documents whose YAML blocks show tenants' pods: the README, the CRDs' and the docs' pages."""
VLLM_MANIFEST = ROOT / "e2e" / "manifests" / "vllm.yaml"
Manifest = dict[str, Any]


def _pod_specs(document: Manifest) -> list[Manifest]:
    """The pod specs of a Pod, or of a workload's template."""
    if document.get("kind") == "Pod":
        return [document["spec"]]
    template = (document.get("spec") or {}).get("template")
    return [template["spec"]] if template and "containers" in template.get("spec", {}) else []


def tenant_pods() -> dict[str, Manifest]:
    """Every tenant pod spec of the manifests and documents, by where it is."""
    found: dict[str, Manifest] = {}
    for index, document in enumerate(yaml.safe_load_all(VLLM_MANIFEST.read_text())):
        for spec in _pod_specs(document or {}):
            found[f"{VLLM_MANIFEST.relative_to(ROOT)} document {index}"] = spec
    for path in TENANT_DOCUMENTS:
        blocks = re.findall(r"```yaml\n(.*?)```", path.read_text(), re.DOTALL)
        for number, block in enumerate(blocks):
            for document in yaml.safe_load_all(block):
                for spec in _pod_specs(document or {}):
                    found[f"{path.relative_to(ROOT)} yaml block {number}"] = spec
    return found


TENANT_PODS = tenant_pods()


def test_the_tenant_pods_are_found() -> None:
    assert any(where.startswith("e2e/") for where in TENANT_PODS), TENANT_PODS
    assert any(where.startswith("docs/vllm/") for where in TENANT_PODS), TENANT_PODS
    assert any(where.startswith("docs/platform/") for where in TENANT_PODS), TENANT_PODS


@pytest.mark.parametrize("where", sorted(TENANT_PODS))
def test_every_documented_tenant_pod_is_restricted(where: str) -> None:
    assert restricted(TENANT_PODS[where]) == [], where


@pytest.mark.parametrize("namespace", ["team-a", "serving"])
@pytest.mark.parametrize("where", sorted(TENANT_PODS))
def test_every_documented_tenant_pod_stays_restricted_once_wired(
    where: str, namespace: str
) -> None:
    """Wired as a tenant's pod (the pool's CSI volume, read-only: the agent's door), or in
    the pool's engine namespace ("serving": the same volume, the pool's whole directory,
    and the agents' group)."""
    pod = {"metadata": {"labels": {"kvpool.io/cache-pool": "main"}}, "spec": TENANT_PODS[where]}
    pool = PoolFacts("main", "inference", 7400, 256, frozenset({"serving"}))
    wiring = wire(pod, namespace, [Binding("kvpool-cache", "inference", pool)])
    assert wiring.patch, wiring
    wired = copy.deepcopy(pod)
    apply(wiring.patch, wired)
    (volume,) = [volume for volume in wired["spec"]["volumes"] if "csi" in volume]
    assert volume["csi"].get("readOnly", False) == (namespace == "team-a")
    groups = wired["spec"].get("securityContext", {}).get("supplementalGroups", [])
    assert (10001 in groups) == (namespace == "serving")
    assert restricted(wired["spec"]) == [], where


PD_SPEC = {
    "tenants": {"tokensSecretRef": {"name": "tokens"}},
    "index": {
        "enabled": True,
        "fingerprint": {"model": "m", "dtype": "bfloat16", "kvLayout": "nhd"},
        "picker": {
            "enabled": True,
            "selector": {"app": "vllm"},
            "disaggregation": {"enabled": True},
        },
    },
}


@pytest.mark.parametrize("where", sorted(TENANT_PODS))
def test_every_documented_tenant_pod_stays_restricted_with_the_decode_sidecar(where: str) -> None:
    """Wired as a decode pod of a pool that disaggregates: the sidecar is "restricted" on
    its own (its security context says all of it, whatever the pod's says)."""
    labels = {"kvpool.io/cache-pool": "main", "kvpool.io/role": "decode"}
    pod = {"metadata": {"labels": labels}, "spec": TENANT_PODS[where]}
    pool_spec = PoolSpec.parse(PD_SPEC)
    sidecar = DecodeSidecar.of(Pool("main", "inference", "uid"), pool_spec, "kvpool:test")
    pool = PoolFacts("main", "inference", 7400, 256, decode_sidecar=sidecar)
    wiring = wire(pod, "inference", [Binding("kvpool-cache", "inference", pool)])
    wired = copy.deepcopy(pod)
    apply(wiring.patch, wired)
    assert [c["name"] for c in wired["spec"]["initContainers"]][-1] == "kvpool-pd-sidecar"
    assert restricted(wired["spec"]) == [], where
    bare = {"containers": [], "initContainers": wired["spec"]["initContainers"][-1:]}
    assert restricted(bare) == []  # without the pod's own securityContext


GOOD: Manifest = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [
        {
            "name": "vllm",
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
        }
    ],
    "volumes": [{"name": "segment", "csi": {"driver": "csi.kvpool.io"}}],
}
CONTAINER = ("containers", 0, "securityContext")
BROKEN: dict[str, tuple[tuple[Any, ...], Any, str]] = {
    "hostPath": (("volumes", 0), {"name": "shm", "hostPath": {"path": "/dev/shm"}}, "hostPath"),
    "hostIPC": ((), {"hostIPC": True}, "hostIPC"),
    "hostNetwork": ((), {"hostNetwork": True}, "hostNetwork"),
    "privileged": (CONTAINER, {"privileged": True}, "privileged"),
    "escalation": (CONTAINER, {"allowPrivilegeEscalation": True}, "allowPrivilegeEscalation"),
    "root": (("securityContext",), {"runAsNonRoot": False}, "runAsNonRoot"),
    "uid 0": (CONTAINER, {"runAsUser": 0}, "runAsUser is 0"),
    "capability": (CONTAINER, {"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}, "adds"),
    "no drop": (CONTAINER, {"capabilities": {}}, "drop lacks ALL"),
    "unconfined": (("securityContext",), {"seccompProfile": {"type": "Unconfined"}}, "seccomp"),
    "host port": (("containers", 0), {"ports": [{"containerPort": 1, "hostPort": 1}]}, "hostPort"),
    "volume type": (("volumes", 0), {"name": "n", "nfs": {"server": "s"}}, "nfs"),
}


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_the_checker_fails_each_rule(rule: str) -> None:
    assert restricted(GOOD) == []
    where, change, expected = BROKEN[rule]
    pod = copy.deepcopy(GOOD)
    node: Any = pod
    for key in where:
        node = node[key]
    if where and where[0] == "volumes":
        node.clear()
    node.update(change)
    problems = restricted(pod)
    assert problems and any(expected in problem for problem in problems), problems
