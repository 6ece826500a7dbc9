"""The pure mutation: a pod labelled ``kvpool.io/cache-pool`` and what the operator knows
(its namespace's tenants, the pools) in; a JSON patch and warnings out. No I/O.

The patch adds, and replaces nothing: the volume ``kvpool-segment`` (an inline volume of
the CSI driver ``csi.kvpool.io``, attributes ``pool`` and ``namespace``), and in every
container of ``spec.containers`` (init containers are left alone) its mount at
``/var/run/kvpool`` and the connector's environment: ``KVPOOL_CONNECTOR_ENDPOINT`` (the
pool Service's ZMQ port, so that the connector never asks the Kubernetes API),
``KVPOOL_CONNECTOR_DOOR_PATH`` (the agent's door, a Unix socket),
``KVPOOL_CONNECTOR_CHUNK_TOKENS``, ``KVPOOL_CONNECTOR_TOKEN`` and ``KVPOOL_CACHE_SALT`` from
the tenant's Secret ``<tenant>-kvpool`` (``optional``: a refused tenant's pod starts, and
its connector says why), then the connector variables again by their old names
(``KVPOOL_ENDPOINT`` ..., :data:`~kvpool.common.names.CONNECTOR_OLD_NAMES`) with the same
values: a pod whose image holds a connector from before the rename finds its variables,
and a newer connector reads the new names without a warning (both names, one value). Each
variable is added unless the container already sets it by either name, so that the
container's own value is the one its connector reads, as before the rename; no token for a
container that sets its own token file (by either name), which the token would beat.

What the CSI plugin publishes in that volume depends on the pod's namespace, as the
kubelet tells it. A tenant's pod (any namespace but the pool's ``engineNamespaces``) gets
only the pool directory's door (``segment.door/``), read-only (the volume and its mounts
say ``readOnly`` too): ``KVPOOL_CONNECTOR_DOOR_PATH`` is ``/var/run/kvpool/agent.sock``,
and the door hands its connector the chunk files its token may map (its own tenant's, and
its spaces'), so it needs no group. A pod of one of the pool's ``engineNamespaces``
(engines the platform team runs and trusts as it trusts the agents) gets the pool's whole
directory, whose probe table lists every tenant's keys on the node:
``KVPOOL_CONNECTOR_DOOR_PATH`` is ``/var/run/kvpool/segment.door/agent.sock``, and it gets
``KVPOOL_CONNECTOR_SEGMENT_PATH`` (beside which its scheduler reads the probe table) and
the agents' group (10001) in ``spec.securityContext.supplementalGroups`` too: the probe
table is 0640 in a 0710 directory of that group, so the pod's own (non-root) uid may read
it.

A pod of the pool's namespace labelled ``kvpool.io/role: decode`` or ``both``, of a pool
whose picker disaggregates prefill from decode, gets the decode sidecar too
(:mod:`~kvpool.operator.admission.sidecar`): an init container that keeps running, and the
pool's key Secret as a volume that only it mounts.

Nothing privileged: no hostPath, no capability, no user change (Pod Security
"restricted" allows csi volumes). A pod that already has the volume is left as it is. A
label that names no pool of one tenant of the namespace (none, several, a value that is no
DNS label, a tenant whose pool is not there or does not accept it) leaves the pod
unchanged, with one warning line that names the value and the namespace.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.common.names import (
    CACHE_POOL_LABEL,
    CACHE_SALT_ENV,
    CONNECTOR_CHUNK_TOKENS_ENV,
    CONNECTOR_DOOR_PATH_ENV,
    CONNECTOR_ENDPOINT_ENV,
    CONNECTOR_OLD_NAMES,
    CONNECTOR_SEGMENT_PATH_ENV,
    CONNECTOR_TOKEN_ENV,
    CONNECTOR_TOKEN_FILE_ENV,
    CSI_DRIVER,
    CSI_NAMESPACE_ATTRIBUTE,
    CSI_POOL_ATTRIBUTE,
    DOOR_DIRECTORY,
    DOOR_SOCKET,
    SEGMENT_FILE,
    SEGMENT_MOUNT_DIR,
    service_name,
)
from kvpool.operator.admission.sidecar import DecodeSidecar, Injection, inject
from kvpool.operator.render.pods import AGENT_UID
from kvpool.operator.tenants import SECRET_SUFFIX

VOLUME = "kvpool-segment"
"""The name of the pool's volume (and of its mounts): the pool's directory in an engine's
pod, its door in a tenant's."""
AGENT_GROUP = AGENT_UID
"""The agents' group, which owns a pool's segment directory on a node."""
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_LABEL_MAX = 63
_UNWIRED = "the pod runs without the cache"
_NEW_NAMES = {old: new for new, old in CONNECTOR_OLD_NAMES.items()}

Obj = Mapping[str, Any]
JsonPatch = list[dict[str, Any]]


@dataclass(frozen=True)
class PoolFacts:
    """What a pod needs of its pool: where its Service is, and its chunk size."""

    name: str
    namespace: str
    zmq_port: int
    chunk_tokens: int
    engine_namespaces: frozenset[str] = frozenset()
    """Namespaces whose pods map the node's segment (``spec.engineNamespaces``)."""
    decode_sidecar: DecodeSidecar | None = None
    """The decode pods' sidecar (None: the pool does not disaggregate)."""


@dataclass(frozen=True)
class Binding:
    """A KVCacheTenant of the pod's namespace that binds a pool of the label's name: the
    tenant, its pool's namespace, and the pool (None: no such pool, or not a valid one)."""

    tenant: str
    pool_namespace: str
    pool: PoolFacts | None
    refused: str = ""
    """Why the pool does not accept the tenant (its Accepted condition's reason; empty:
    accepted, or not decided yet)."""


@dataclass(frozen=True)
class Wiring:
    """The JSON patch (RFC 6902; empty: the pod is admitted as it is) and the warnings."""

    patch: JsonPatch = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def is_pool_name(value: str) -> bool:
    """A label value that can name a pool: a DNS label."""
    return len(value) <= _DNS_LABEL_MAX and _DNS_LABEL.fullmatch(value) is not None


def _quoted(value: str) -> str:
    """A label value in a warning: printable ASCII only (warnings travel in HTTP headers)."""
    text = value if value.isascii() and value.isprintable() else ascii(value)[1:-1]
    return f"'{text[:80]}'" if not is_pool_name(value) else text


def wire(pod: Obj, namespace: str, bindings: Sequence[Binding]) -> Wiring:
    """The patch for ``pod`` (being created in ``namespace``), given the tenants of the
    namespace whose ``poolRef.name`` is the value of the pod's label."""
    value = str((pod.get("metadata") or {}).get("labels", {}).get(CACHE_POOL_LABEL, ""))
    spec = pod.get("spec") or {}
    if any(volume.get("name") == VOLUME for volume in spec.get("volumes") or ()):
        return Wiring()
    if not is_pool_name(value):
        return _unwired(
            f"label {CACHE_POOL_LABEL}={_quoted(value)} in namespace {namespace} is not a "
            f"pool name (a DNS label)"
        )
    if not bindings:
        return _unwired(f"no KVCacheTenant in namespace {namespace} binds pool {value}")
    if len(bindings) > 1:
        names = ", ".join(sorted(binding.tenant for binding in bindings))
        return _unwired(
            f"{len(bindings)} KVCacheTenants in namespace {namespace} bind pool {value} "
            f"({names}); label the pod for one pool of one tenant"
        )
    binding = bindings[0]
    if binding.pool is None:
        return _unwired(
            f"KVCacheTenant {namespace}/{binding.tenant} binds pool "
            f"{binding.pool_namespace}/{value}, which does not exist or is not valid"
        )
    if binding.refused:
        # the agents refuse its token (its messages and its door alike): say why here
        return _unwired(
            f"KVCacheTenant {namespace}/{binding.tenant} is not accepted by pool "
            f"{binding.pool_namespace}/{value} ({binding.refused})"
        )
    pool = binding.pool
    maps_segment = namespace in pool.engine_namespaces
    sidecar = inject(pod, namespace, pool.name, pool.namespace, pool.decode_sidecar)
    patch = _patch(spec, binding.tenant, pool, maps_segment, sidecar)
    return Wiring(patch=patch, warnings=sidecar.warnings)


def _unwired(problem: str) -> Wiring:
    return Wiring(warnings=[f"kvpool: {problem}; {_UNWIRED}"])


def volume(pool: PoolFacts, maps_segment: bool) -> dict[str, Any]:
    """The pool's CSI volume: read-only in a tenant's pod (the plugin publishes it so
    anyway)."""
    source: dict[str, Any] = {
        "driver": CSI_DRIVER,
        "volumeAttributes": {
            CSI_POOL_ATTRIBUTE: pool.name,
            CSI_NAMESPACE_ATTRIBUTE: pool.namespace,
        },
    }
    if not maps_segment:
        source["readOnly"] = True
    return {"name": VOLUME, "csi": source}


def mount(maps_segment: bool) -> dict[str, Any]:
    """The volume's mount in each container: read-only in a tenant's pod."""
    found = {"name": VOLUME, "mountPath": str(SEGMENT_MOUNT_DIR)}
    return found if maps_segment else {**found, "readOnly": True}


def environment(tenant: str, pool: PoolFacts, maps_segment: bool) -> list[dict[str, Any]]:
    """The connector's variables, in this order (``KVPOOL_CONNECTOR_SEGMENT_PATH`` only for a
    pod that maps the segment), then those of them that had another name before, by that
    name, in the same order. ``KVPOOL_CONNECTOR_DOOR_PATH`` is the door socket in the volume:
    in the ``door/`` of the pool's directory that an engine's pod gets, at the top of the
    door that a tenant's pod gets."""
    secret = f"{tenant}{SECRET_SUFFIX}"

    def from_secret(name: str, key: str) -> dict[str, Any]:
        ref = {"name": secret, "key": key, "optional": True}
        return {"name": name, "valueFrom": {"secretKeyRef": ref}}

    endpoint = f"tcp://{service_name(pool.name)}.{pool.namespace}.svc:{pool.zmq_port}"
    variables = [{"name": CONNECTOR_ENDPOINT_ENV, "value": endpoint}]
    door = SEGMENT_MOUNT_DIR / DOOR_SOCKET  # the volume is the door
    if maps_segment:  # the volume is the pool's directory
        segment = SEGMENT_MOUNT_DIR / SEGMENT_FILE
        variables.append({"name": CONNECTOR_SEGMENT_PATH_ENV, "value": str(segment)})
        door = SEGMENT_MOUNT_DIR / DOOR_DIRECTORY / DOOR_SOCKET
    variables += [
        {"name": CONNECTOR_DOOR_PATH_ENV, "value": str(door)},
        {"name": CONNECTOR_CHUNK_TOKENS_ENV, "value": str(pool.chunk_tokens)},
        from_secret(CONNECTOR_TOKEN_ENV, "token"),
        from_secret(CACHE_SALT_ENV, "salt"),
    ]
    old = [
        {**variable, "name": CONNECTOR_OLD_NAMES[variable["name"]]}
        for variable in variables
        if variable["name"] in CONNECTOR_OLD_NAMES
    ]
    return [*variables, *old]


def _patch(
    spec: Obj, tenant: str, pool: PoolFacts, maps_segment: bool, sidecar: Injection
) -> JsonPatch:
    patch: JsonPatch = []
    volumes = [volume(pool, maps_segment), *sidecar.volumes]
    _append(patch, "/spec/volumes", spec.get("volumes"), volumes)
    _append(patch, "/spec/initContainers", spec.get("initContainers"), sidecar.init_containers)
    variables = environment(tenant, pool, maps_segment)
    for number, container in enumerate(spec.get("containers") or ()):
        path = f"/spec/containers/{number}"
        _append(patch, f"{path}/volumeMounts", container.get("volumeMounts"), [mount(maps_segment)])
        own = {_new_name(str(variable.get("name"))) for variable in container.get("env") or ()}
        if CONNECTOR_TOKEN_FILE_ENV in own:  # its own token file (a token would win)
            own.add(CONNECTOR_TOKEN_ENV)
        added = [variable for variable in variables if _new_name(variable["name"]) not in own]
        _append(patch, f"{path}/env", container.get("env"), added)
    if maps_segment:
        _add_agent_group(patch, spec.get("securityContext"))
    return patch


def _new_name(name: str) -> str:
    """A connector variable's new name, whichever name it has: a container that sets a
    variable by either name keeps it, and gets neither name from the webhook."""
    return _NEW_NAMES.get(name, name)


def _add_agent_group(patch: JsonPatch, context: Obj | None) -> None:
    if context is None:
        value = {"supplementalGroups": [AGENT_GROUP]}
        patch.append({"op": "add", "path": "/spec/securityContext", "value": value})
        return
    groups = context.get("supplementalGroups")
    if AGENT_GROUP not in (groups or ()):
        _append(patch, "/spec/securityContext/supplementalGroups", groups, [AGENT_GROUP])


def _append(patch: JsonPatch, path: str, current: object, items: list[Any]) -> None:
    """Add ``items`` at the end of the list at ``path`` (``current``: absent, None, or the
    list there now)."""
    if not items:
        return
    if not current:
        patch.append({"op": "add", "path": path, "value": items})
    else:
        patch += [{"op": "add", "path": f"{path}/-", "value": item} for item in items]


def apply(patch: JsonPatch, body: dict[str, Any]) -> None:
    """Apply the ``add`` operations of :func:`wire`'s patch to ``body`` in place."""
    for operation in patch:
        if operation["op"] != "add":
            raise ValueError(f"only 'add' is applied here, not {operation['op']!r}")
        *parents, last = operation["path"].removeprefix("/").split("/")
        target: Any = body
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        value = copy.deepcopy(operation["value"])
        if isinstance(target, list):
            if last == "-":
                target.append(value)
            else:
                target.insert(int(last), value)
        else:
            target[last] = value
