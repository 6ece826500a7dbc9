"""The manifests the README's "Try it" applies are valid Kubernetes objects, and the vLLM one
names what the operator makes for the pool and the team (a rename breaks this test)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from kvpool_agent.names import service_name
from kvpool_operator.render import AGENT_UID
from kvpool_operator.tenants import SALT_KEY, SECRET_SUFFIX, TOKEN_KEY

MANIFESTS = Path(__file__).with_name("manifests")


def _documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc]


def test_the_vllm_manifest_is_valid_and_names_the_pools_and_teams_objects() -> None:
    (pool,), (tenant,) = _documents("pool.yaml"), _documents("tenant.yaml")
    documents = _documents("vllm.yaml")
    for document in documents:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)
    by_kind = {document["kind"]: document for document in documents}
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    secret = tenant["metadata"]["name"] + SECRET_SUFFIX
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert refs["KVPOOL_TOKEN"] == {"name": secret, "key": TOKEN_KEY}
    assert refs["KVPOOL_CACHE_SALT"] == {"name": secret, "key": SALT_KEY}
    transfer = json.loads(
        container["command"][container["command"].index("--kv-transfer-config") + 1]
    )
    ref = tenant["spec"]["poolRef"]
    assert transfer["kv_connector_extra_config"] == {
        "pool": ref["name"],
        "namespace": ref["namespace"],
    }
    assert pool["metadata"]["name"] == ref["name"]
    assert AGENT_UID in pod["securityContext"]["supplementalGroups"]
    assert {"name": "kvpool-shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}} in pod[
        "volumes"
    ]
    role, binding = by_kind["Role"], by_kind["RoleBinding"]
    assert role["metadata"]["namespace"] == ref["namespace"]
    assert role["rules"][0]["resourceNames"] == [service_name(ref["name"])]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
