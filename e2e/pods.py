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

from tests.support.engines import MAIN as ENGINE_MAIN
from tests.support.engines import Engine

from .cluster import Kubelet, Manifest, Pod

BIN = Path(sys.executable).parent
SALT_ENV = "KVPOOL_CACHE_SALT"
TOKEN_ENV = "KVPOOL_TOKEN"


def from_secret(name: str, secret: str, key: str) -> dict[str, object]:
    """A container's environment variable from a key of a Secret of the pod's namespace."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


@dataclass
class PodEngine(Engine):
    """A vLLM engine (``tests/support/engine_main.py``) run as a pod by a kubelet."""

    kubelet: Kubelet | None = None
    namespace: str = ""
    salt_secret: str = ""
    """The team's Secret: its ``salt`` is the pod's :data:`SALT_ENV`, its ``token`` the
    connector's :data:`TOKEN_ENV`."""
    pod: Pod | None = None

    def start(self) -> PodEngine:
        assert self.kubelet is not None
        template = vllm_pod(
            [sys.executable, str(ENGINE_MAIN), json.dumps(self.settings)], ENGINE_ENV
        )
        template["spec"]["containers"][0]["env"] += [
            from_secret(SALT_ENV, self.salt_secret, "salt"),
            from_secret(TOKEN_ENV, self.salt_secret, "token"),  # the team's token for the agent
        ]
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
    """A vLLM pod as the chart's NOTES tell a user to write it: the node's /dev/shm."""
    return {
        "metadata": {"labels": {"app": "vllm"}},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "command": command,
                    "env": [{"name": name, "value": value} for name, value in env.items()],
                    "volumeMounts": [{"name": "kvpool-shm", "mountPath": "/dev/shm"}],
                }
            ],
            "volumes": [
                {"name": "kvpool-shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}}
            ],
        },
    }


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
