"""The decode pods' sidecar of prefill/decode disaggregation (pure, as the rest of the
mutation): which wired pods get ``kvpool-pd-sidecar``, and the container they get.

A pool whose ``spec.index.picker.disaggregation`` is enabled has its picker send some
requests to a decode-capable pod (``kvpool.io/role: decode``, or ``both``: the picker
decodes on both) with a signed header naming the prefill pod; only a sidecar on that pod
acts on it. So a wired pod of the pool's namespace labelled ``decode`` or ``both`` gets,
at the end of its init containers:

- ``kvpool-pd-sidecar``, a native sidecar (``restartPolicy: Always``: it starts before,
  and stops after, the pod's containers), running the pool index's image, listening on
  ``picker.targetPort`` (the InferencePool's) and forwarding to the pod's vLLM on
  ``127.0.0.1:<disaggregation.vllmPort>``, its node from the downward API
  (``NODE_NAME``), under Pod Security "restricted" on its own (non-root, no privilege
  escalation, no capability, the runtime's seccomp profile, a read-only root);
- the pool's key Secret ``kvpool-<pool>-pd-key``, mounted read-only into it alone.

Not a pod without the label (the picker takes it for ``both``, but its vLLM listens on the
target port, where the sidecar would): a request it is sent with a prefill header is served
whole, as before. Not a ``prefill`` pod: a decode's sidecar POSTs its prefill straight to
its vLLM. Not a pod of another namespace: the picker routes only the pool's namespace's
pods, and the key stays in that namespace (a warning says so). Not a pod that has a
container of the sidecar's name already.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.common.names import NODE_NAME_ENV, ROLE_LABEL
from kvpool.operator.render.config import PD_KEY_PATH
from kvpool.operator.render.index import index_image
from kvpool.operator.render.objects import Pool
from kvpool.operator.render.pods import (
    AGENT_UID,
    container_security,
    pd_key_volume,
    resources,
)
from kvpool.operator.spec import PoolSpec

SIDECAR = "kvpool-pd-sidecar"
"""The container's name, and its command."""
DECODING_ROLES = frozenset({"decode", "both"})
SIDECAR_CPU_REQUEST = "100m"
SIDECAR_MEMORY_REQUEST = "128Mi"
SIDECAR_MEMORY_LIMIT = "1Gi"
"""It holds each request body whole (8 MiB at most) while it prefills; 1Gi is room for a
hundred at once. spec.index.picker.disaggregation.resources overrides these."""

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class DecodeSidecar:
    """What a decode pod's sidecar needs of its pool."""

    image: str
    image_pull_policy: str
    port: int
    """Where it listens: the InferencePool's target port (``picker.targetPort``)."""
    vllm_port: int
    """Where the pod's vLLM listens, on 127.0.0.1."""
    key_secret: str
    decode_wait_ms: int
    prefill_timeout_seconds: int
    resources: Mapping[str, Mapping[str, int | str]] = field(default_factory=dict)

    @classmethod
    def of(cls, pool: Pool, spec: PoolSpec, default_image: str) -> DecodeSidecar | None:
        """The pool's sidecar; None when it does not disaggregate."""
        if not spec.index.disaggregates:
            return None
        pd = spec.index.picker.disaggregation
        return cls(
            image=index_image(spec, default_image),
            image_pull_policy=spec.agent.image_pull_policy,
            port=spec.index.picker.target_port,
            vllm_port=pd.vllm_port,
            key_secret=pool.pd_key_name,
            decode_wait_ms=pd.decode_wait_ms,
            prefill_timeout_seconds=pd.prefill_timeout_seconds,
            resources=resources(
                {"cpu": SIDECAR_CPU_REQUEST, "memory": SIDECAR_MEMORY_REQUEST},
                {"memory": SIDECAR_MEMORY_LIMIT},
                pd.resources,
            ),
        )

    def container(self) -> dict[str, Any]:
        """The native sidecar container (an init container that keeps running)."""
        _, mount = pd_key_volume(self.key_secret)
        node = {"fieldRef": {"fieldPath": "spec.nodeName"}}
        return {
            "name": SIDECAR,
            "image": self.image,
            "imagePullPolicy": self.image_pull_policy,
            "restartPolicy": "Always",
            "command": [SIDECAR],
            "args": [
                f"--port={self.port}",
                f"--vllm=http://127.0.0.1:{self.vllm_port}",
                f"--key-file={PD_KEY_PATH}",
                f"--decode-wait-ms={self.decode_wait_ms}",
                f"--prefill-timeout-s={self.prefill_timeout_seconds}",
            ],
            "env": [{"name": NODE_NAME_ENV, "valueFrom": node}],
            "resources": {kind: dict(values) for kind, values in self.resources.items()},
            # its own, whatever the pod's: "restricted" whether or not the pod sets them
            "securityContext": {
                **container_security(),
                "runAsNonRoot": True,
                "runAsUser": AGENT_UID,
                "runAsGroup": AGENT_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumeMounts": [mount],
        }

    def volume(self) -> dict[str, Any]:
        volume, _ = pd_key_volume(self.key_secret)
        return volume


@dataclass(frozen=True)
class Injection:
    """What a pod gets for its decode sidecar (nothing, for most pods), and the warnings."""

    init_containers: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def inject(
    pod: Obj, namespace: str, pool_name: str, pool_namespace: str, sidecar: DecodeSidecar | None
) -> Injection:
    """The sidecar for ``pod`` (being created in ``namespace``), wired to the pool
    ``pool_namespace/pool_name`` whose sidecar is ``sidecar`` (None: it does not
    disaggregate)."""
    role = str(((pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL, ""))
    if sidecar is None or role not in DECODING_ROLES:
        return Injection()
    if namespace != pool_namespace:
        return Injection(
            warnings=[
                f"kvpool: label {ROLE_LABEL}={role} in namespace {namespace}: the picker of "
                f"pool {pool_namespace}/{pool_name} routes only pods of {pool_namespace}; "
                "the pod runs without the decode sidecar"
            ]
        )
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]
    if any(container.get("name") == SIDECAR for container in containers):
        return Injection()
    taken = [
        f"kvpool: container {container.get('name')} declares port {sidecar.port}, where the "
        f"decode sidecar listens: serve its vLLM on port {sidecar.vllm_port} "
        "(spec.index.picker.disaggregation.vllmPort)"
        for container in spec.get("containers") or ()
        if any(port.get("containerPort") == sidecar.port for port in container.get("ports") or ())
    ]
    return Injection([sidecar.container()], [sidecar.volume()], taken)
