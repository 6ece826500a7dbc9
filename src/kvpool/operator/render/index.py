"""The prefix index (when ``spec.index.enabled``), labelled
``app.kubernetes.io/component: index`` (so the agents' Service and DaemonSet never select
its pods, nor the index's discovery, which follows ``component: agent`` pods):
``kvpool-<pool>-index-config`` (ConfigMap, ``index.yaml``), and ``kvpool-<pool>-index``:
ServiceAccount, Role and RoleBinding to read and watch the pool's pods, a Deployment of
``spec.index.replicas`` independent indexes, and a ClusterIP Service for gateways.

With ``spec.index.picker`` each replica also serves the endpoint picker (gRPC, the
container and Service port ``grpc-picker``, ``appProtocol: kubernetes.io/h2c``) that an
InferencePool's ``endpointPickerRef`` names; it finds the model server pods with the same
Role (they are in the pool's namespace, as the InferencePool that selects them). Readiness
stays the index's HTTP ``/readyz``; a gateway health-checks the picker over gRPC.

With ``spec.index.picker.disaggregation`` each replica mounts the pool's disaggregation key
Secret (``kvpool-<pool>-pd-key``, made by the operator before the Deployment) and signs its
prefill headers with it; the pod template carries the key's generation, so that a new key
rolls the replicas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.common.names import INDEX_COMPONENT, INDEX_CONFIG_FILE_ENV, INDEX_CONFIG_KEY
from kvpool.operator.render.config import (
    PD_KEY_GENERATION_ANNOTATION,
    index_config,
    settings_file,
)
from kvpool.operator.render.objects import ChildRef, Manifest, Pool, manifest
from kvpool.operator.render.pods import (
    CONFIG_DIR,
    agent_access_volume,
    config_volume,
    container_ports,
    container_security,
    pd_key_volume,
    peer_keys_volume,
    pod_security,
    pod_template,
    probes,
    resources,
    state_volume,
    tokenizer_volume,
    tokens_volume,
)
from kvpool.operator.render.rbac import index_rbac
from kvpool.operator.render.services import H2C, service_ports
from kvpool.operator.spec import PoolSpec

PICKER_PORT_NAME = "grpc-picker"
"""The picker's container and Service port (an InferencePool names it by number)."""
PLACEMENT_EVENTS_PORT_NAME = "kv-events"
PLACEMENT_REPLAY_PORT_NAME = "kv-replay"
"""The placement events' ports (ZMQ, for routers that read vLLM's KV events)."""
INDEX_CPU_REQUEST = "100m"
INDEX_MEMORY_REQUEST = "512Mi"
INDEX_MEMORY_LIMIT = "2Gi"
"""The index's memory grows with the chunks it tracks (about 150 B each, keys included,
by ``kvpool bench index``): 2Gi holds about ten nodes' worth of maxChunksPerNode 1M. Its
node count is unknown at render time, so these are defaults that spec.index.resources
overrides."""


@dataclass(frozen=True)
class IndexChildren:
    """The prefix index's children, in the order they are applied (the Deployment last)."""

    config: Manifest
    service_account: Manifest
    role: Manifest
    role_binding: Manifest
    service: Manifest
    deployment: Manifest

    def manifests(self) -> list[Manifest]:
        return [
            self.config,
            self.service_account,
            self.role,
            self.role_binding,
            self.service,
            self.deployment,
        ]


def index_refs(pool: Pool) -> tuple[ChildRef, ...]:
    """The children the index adds, in the order they are deleted (the Deployment first)."""
    return (
        ChildRef("apps/v1", "Deployment", pool.index_name),
        ChildRef("v1", "Service", pool.index_name),
        ChildRef("rbac.authorization.k8s.io/v1", "RoleBinding", pool.index_name),
        ChildRef("rbac.authorization.k8s.io/v1", "Role", pool.index_name),
        ChildRef("v1", "ServiceAccount", pool.index_name),
        ChildRef("v1", "ConfigMap", pool.index_config_name),
    )


def index_children(pool: Pool, spec: PoolSpec, default_image: str) -> IndexChildren:
    config_text = settings_file(index_config(pool, spec))
    service_account, role, role_binding = index_rbac(pool)
    return IndexChildren(
        config=manifest(
            "v1",
            "ConfigMap",
            pool,
            pool.index_config_name,
            component=INDEX_COMPONENT,
            data={INDEX_CONFIG_KEY: config_text},
        ),
        service_account=service_account,
        role=role,
        role_binding=role_binding,
        service=manifest(
            "v1",
            "Service",
            pool,
            pool.index_name,
            component=INDEX_COMPONENT,
            spec={
                "type": "ClusterIP",
                "selector": pool.selector(INDEX_COMPONENT),
                "ports": service_ports(index_ports(spec), {PICKER_PORT_NAME: H2C}),
            },
        ),
        deployment=_index_deployment(pool, spec, config_text, default_image),
    )


def index_ports(spec: PoolSpec) -> list[tuple[str, int]]:
    """The index's HTTP port, and the picker's and its placement events' where it has
    them."""
    picker = spec.index.picker
    if not picker.enabled:
        return [("http", spec.index.port)]
    optional = [
        (PLACEMENT_EVENTS_PORT_NAME, picker.placement_events_port),
        (PLACEMENT_REPLAY_PORT_NAME, picker.placement_events_replay_port),
    ]
    return [("http", spec.index.port), (PICKER_PORT_NAME, picker.port)] + [
        (name, port) for name, port in optional if port is not None
    ]


def index_image(spec: PoolSpec, default_image: str) -> str:
    """The index's image (the decode pods' sidecar runs it too): ``spec.index.image``, else
    the agents'."""
    return spec.index.image or spec.agent.image or default_image


def _index_deployment(pool: Pool, spec: PoolSpec, config_text: str, default_image: str) -> Manifest:
    index = spec.index
    volumes = [
        config_volume(pool.index_config_name),
        state_volume(),
        *tokens_volume(spec),
        agent_access_volume(pool),
        *peer_keys_volume(pool, spec),  # it accepts the agents' lookup tokens derived from it
        *tokenizer_volume(spec),
        *([pd_key_volume(pool.pd_key_name)] if index.disaggregates else []),
    ]
    container = {
        "name": "index",
        "image": index_image(spec, default_image),
        "imagePullPolicy": spec.agent.image_pull_policy,
        "command": ["kvpool-index"],
        "env": [{"name": INDEX_CONFIG_FILE_ENV, "value": f"{CONFIG_DIR}/{INDEX_CONFIG_KEY}"}],
        "ports": container_ports(index_ports(spec)),
        "resources": resources(
            {"cpu": INDEX_CPU_REQUEST, "memory": INDEX_MEMORY_REQUEST},
            {"memory": INDEX_MEMORY_LIMIT},
            index.resources,
        ),
        **probes(startup_failures=30),
        "securityContext": container_security(),
        "volumeMounts": [mount for _, mount in volumes],
    }
    scheduling: dict[str, Any] = {
        "nodeSelector": index.node_selector,
        "tolerations": list(index.tolerations),
        # replicas on different nodes where the cluster allows: one node's loss leaves routes
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": pool.selector(INDEX_COMPONENT)},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            }
        }
        if index.replicas > 1
        else None,
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": pool.index_name,
        "securityContext": pod_security(),
        **{key: value for key, value in scheduling.items() if value},
        "containers": [container],
        "volumes": [volume for volume, _ in volumes],
    }
    template = pod_template(pool, INDEX_COMPONENT, config_text, pod_spec)
    if index.disaggregates:  # a new key rolls the replicas (they read it at start)
        generation = str(index.picker.disaggregation.key_generation)
        template["metadata"]["annotations"][PD_KEY_GENERATION_ANNOTATION] = generation
    return manifest(
        "apps/v1",
        "Deployment",
        pool,
        pool.index_name,
        component=INDEX_COMPONENT,
        spec={
            "replicas": index.replicas,
            "selector": {"matchLabels": pool.selector(INDEX_COMPONENT)},
            "template": template,
        },
    )
