"""The manifests docs/platform/try-it.md applies are valid Kubernetes objects, and the vLLM one
names the team's pool by its label and nothing else of kvpool (a rename breaks this test)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from kvpool.common.names import CACHE_POOL_LABEL

MANIFESTS = Path(__file__).with_name("manifests")


def _documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc]


def test_the_vllm_manifest_is_valid_and_names_the_pool_by_label_only() -> None:
    (pool,), (tenant,) = _documents("pool.yaml"), _documents("tenant.yaml")
    documents = _documents("vllm.yaml")
    for document in documents:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)
    (deployment,) = documents
    template = deployment["spec"]["template"]
    ref = tenant["spec"]["poolRef"]
    assert pool["metadata"]["name"] == ref["name"]
    assert template["metadata"]["labels"][CACHE_POOL_LABEL] == ref["name"]
    pod = template["spec"]
    (container,) = pod["containers"]
    transfer = json.loads(
        container["command"][container["command"].index("--kv-transfer-config") + 1]
    )
    assert transfer["kv_connector_extra_config"] == {
        "pool": ref["name"],
        "namespace": ref["namespace"],
    }
    # nothing else of kvpool: the webhook adds the door's volume and the environment
    assert "volumes" not in pod and "env" not in container and "volumeMounts" not in container
    assert "serviceAccountName" not in pod  # no Role to bind
