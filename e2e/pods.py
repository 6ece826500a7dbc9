"""What the e2e's pods run: vLLM engines written as a user writes a vLLM pod, and the
"image" every container runs (this Python environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.engines import MAIN as ENGINE_MAIN
from tests.support.engines import Engine

from .cluster import Kubelet, Manifest, Pod

MANIFESTS = Path(__file__).with_name("manifests")

BIN = Path(sys.executable).parent
SALT_ENV = "KVPOOL_CACHE_SALT"
TOKEN_ENV = "KVPOOL_CONNECTOR_TOKEN"


def from_secret(name: str, secret: str, key: str) -> dict[str, object]:
    """A container's environment variable from a key of a Secret of the pod's namespace."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


@dataclass
class PodEngine(Engine):
    """A vLLM engine (``tests/support/engine_main.py``) run as a pod by a kubelet."""

    kubelet: Kubelet | None = None
    namespace: str = ""
    pod: Pod | None = None

    def start(self) -> PodEngine:
        assert self.kubelet is not None
        # labelled for the pool and nothing else: the webhook adds the agent's door (a
        # read-only volume) and the team's token and salt (SALT_ENV, TOKEN_ENV) from its Secret
        template = vllm_pod(
            [sys.executable, str(ENGINE_MAIN), json.dumps(self.settings)], ENGINE_ENV
        )
        log = self.log_path.open("w")
        self.pod = self.kubelet.run(
            self.name,
            self.namespace,
            template,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
        )
        self._process = self.pod.process
        threading.Thread(target=self._read, daemon=True).start()
        return self


ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def vllm_pod(command: list[str], env: dict[str, str]) -> Manifest:
    """The pod of ``manifests/vllm.yaml``, the one docs/platform/try-it.md tells a team to
    write (its label, its restricted security context), running ``command`` with ``env``."""
    documents = yaml.safe_load_all((MANIFESTS / "vllm.yaml").read_text())
    (deployment,) = [doc for doc in documents if doc and doc["kind"] == "Deployment"]
    template: Manifest = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    container["command"] = command
    container["env"] = [{"name": name, "value": value} for name, value in env.items()]
    return template


def restricted(template: Manifest) -> Manifest:
    """``template`` with the security context Pod Security "restricted" asks of a pod, as
    the vLLM pod of ``manifests/vllm.yaml`` has it."""
    documented = vllm_pod([], {})["spec"]
    spec = template["spec"]
    spec["securityContext"] = documented["securityContext"]
    for container in spec["containers"]:
        container["securityContext"] = documented["containers"][0]["securityContext"]
    return template


def image_env() -> dict[str, str]:
    """The "image" every container runs: this Python environment, nothing of the caller's
    cluster or kvpool settings."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("KVPOOL_", "KUBERNETES_", "PYTEST_")) and key != "KUBECONFIG"
    }
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", os.defpath)])
    env["PYTHONUNBUFFERED"] = "1"
    return env
