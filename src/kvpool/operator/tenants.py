"""KVCacheTenants: a team's binding to a pool, made in the team's own namespace.

Entry points, each called by a thin kopf handler (``handlers.py``):

- :meth:`TenantReconciler.tenant_changed`: the tenant was created or changed, found at the
  operator's start, its pool changed, or its periodic re-check came (a namespace whose
  labels no longer match loses its token). Admission: the pool exists, its
  ``spec.tenants.allowedNamespaces`` selects the tenant's namespace (absent or empty: no
  namespace), the quota is within ``spec.tenants.maxQuota``, the salt is there (the team's
  Secret, or one the operator generates), and no other tenant of the pool has the same
  tenant id. Accepted: the Secret ``<name>-kvpool`` holds the token (minted anew when
  ``spec.tokenGeneration`` changes), the salt (if generated), the tenant id, the pool and
  its endpoint, and the salt of each of the pool's shared spaces that admits it
  (``space-<name>``; :mod:`kvpool.operator.spaces`, whose members follow the tenant's
  entry); the pool's tenants ConfigMap holds the token's digest and the quota ceiling
  under the tenant id; the pool's quota ConfigMap holds the quota, written when the CR's
  quota changes (between changes, the tenant's own HTTP sets stand). Refused: the entry
  leaves the tenants ConfigMap (and so the spaces' members), the token and the spaces' salts
  leave the Secret (the Secret, its salt and tenant id stay, so that a tenant accepted again
  keeps its cache).
- :meth:`TenantReconciler.tenant_deleted`: revoke (the entry leaves the tenants ConfigMap:
  the agents drop the token on their next watch event), clear the tenant's chunks on every
  agent (L1, NVMe, S3), drop its quota. Agents that cannot be reached make the caller retry;
  after its last retry the deletion completes anyway and a Warning says which agents kept
  what (their L1 chunks age out by eviction; the S3 prefix was cleared by any agent that
  answered).
- :meth:`TenantReconciler.read_usage`: the tenant's usage, summed over the pool's agents,
  into its status (periodically, never on every change).

Every write is a JSON merge patch of single keys, so tenants reconciled one after another
never overwrite each other's entries; a lock serialises the check for a tenant id in use
with its write. The salt is read from and written to Secrets only: never a log line, an
event, a status or a ConfigMap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvpool.common.keys import tenant_id
from kvpool.common.names import INDEX_COMPONENT, MANAGED_BY_LABEL, OPERATOR
from kvpool.common.quotas import TierLimits, quota_to_configmap
from kvpool.common.tenants_configmap import (
    INDEX_KEY,
    OPERATOR_KEY,
    TenantEntry,
    digest_token,
    encode_role_entry,
)
from kvpool.operator.agents import Agents
from kvpool.operator.apply import KINDS, SECRETS, TENANTS, Cluster
from kvpool.operator.b64 import decoded, encoded
from kvpool.operator.bearer import OperatorToken, mint
from kvpool.operator.events import TenantEvents
from kvpool.operator.pool_maps import PoolMaps
from kvpool.operator.reasons import (
    ACCEPTED,
    INVALID_SALT,
    INVALID_SPEC,
    NAMESPACE_NOT_ALLOWED,
    NOT_ACCEPTED,
    POOL_NOT_FOUND,
    POOL_NOT_READY,
    QUOTA_ABOVE_MAXIMUM,
    READY,
    SALT_SECRET_MISSING,
    TENANT_ID_IN_USE,
    TOKEN_PUBLISHED,
)
from kvpool.operator.render import Pool, format_bytes
from kvpool.operator.render.config import AGENT_ACCESS_KEY
from kvpool.operator.render.objects import manifest
from kvpool.operator.spaces import SpaceReconciler
from kvpool.operator.spaces.handout import handout_changes, salt_key, space_of
from kvpool.operator.spec import (
    API_VERSION,
    KIND,
    TENANT_KIND,
    InvalidSpec,
    LabelSelector,
    PoolSpec,
    TenantSpec,
)
from kvpool.operator.status import Assessment, condition
from kvpool.operator.usage import usage_summary

log = logging.getLogger(__name__)

POOLS = KINDS[API_VERSION, KIND]

SECRET_SUFFIX = "-kvpool"
SALT_KEY = "salt"
TOKEN_KEY = "token"
TENANT_ID_KEY = "tenant-id"
POOL_KEY = "pool"
NAMESPACE_KEY = "namespace"
ENDPOINT_KEY = "endpoint"
TOKEN_GENERATION_ANNOTATION = "kvpool.io/token-generation"
"""On the Secret: the spec.tokenGeneration its token was minted for."""


class Refused(Exception):
    """The pool does not admit the tenant: ``reason`` is the Accepted condition's."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class AgentsUnreachable(RuntimeError):
    """Some agents did not clear a deleted tenant's chunks; the message names them."""


@dataclass(frozen=True)
class Admission:
    """What an accepted tenant binds to."""

    pool: Pool
    pool_spec: PoolSpec
    pool_ready: bool
    salt: str
    generated: bool
    """Whether the operator generated the salt (and keeps it in the tenant's Secret)."""
    tenant_id: str
    secret: Mapping[str, Any] | None
    """The tenant's Secret as it is, if it exists."""


@dataclass(frozen=True)
class _Tenant:
    namespace: str
    name: str
    uid: str
    generation: int

    @classmethod
    def of(cls, tenant: Mapping[str, Any]) -> _Tenant:
        metadata = tenant["metadata"]
        return cls(
            metadata["namespace"],
            metadata["name"],
            metadata["uid"],
            int(metadata.get("generation", 1)),
        )

    @property
    def ref(self) -> str:
        """How the tenants ConfigMap names it."""
        return f"{self.namespace}/{self.name}"

    @property
    def secret_name(self) -> str:
        return f"{self.name}{SECRET_SUFFIX}"


class TenantReconciler:
    def __init__(
        self,
        cluster: Cluster,
        events: TenantEvents,
        agents: Agents,
        token: OperatorToken,
        *,
        spaces: SpaceReconciler,
        lock: threading.Lock,
    ) -> None:
        """``lock``: the one ``spaces`` holds too (both write the tenants ConfigMap)."""
        self._cluster = cluster
        self._events = events
        self._agents = agents
        self._token = token
        self._spaces = spaces
        self._maps = PoolMaps(cluster)
        self._lock = lock

    # ------------------------------------------------------------ admission

    def tenant_changed(self, tenant: Mapping[str, Any]) -> None:
        with self._lock:
            self._reconcile(tenant)

    def refresh(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """Reconcile the tenant as stored now (its pool changed; the periodic re-check) and
        return it; nothing where it is gone or being deleted. Read under the lock that the
        deletion withdraws the token under, so that a re-check racing a deletion never
        publishes the token again after the deletion took it back."""
        with self._lock:
            tenant = self._cluster.get(TENANTS, namespace, name)
            if tenant is None or tenant["metadata"].get("deletionTimestamp"):
                return None
            self._reconcile(tenant)
            return tenant

    def _reconcile(self, tenant: Mapping[str, Any]) -> None:
        who = _Tenant.of(tenant)
        status = tenant.get("status") or {}
        try:
            spec = TenantSpec.parse(tenant.get("spec") or {})
        except InvalidSpec as error:
            self._refuse(tenant, None, Refused(INVALID_SPEC, str(error)))
            return
        try:
            admission = self._admit(who, spec)
        except Refused as refusal:
            self._refuse(tenant, spec, refusal)
            return
        handed = self._spaces.handout(admission.pool, admission.pool_spec, who.namespace)
        token, rotated = self._write_secret(who, spec, admission, handed)
        previous_id = status.get("tenantId")
        if previous_id and previous_id != admission.tenant_id:
            self._withdraw_entry(admission.pool, previous_id, who, drop_quota=True)
        limits = TierLimits(spec.quota.l1, spec.quota.nvme_bytes)
        ceiling = {"l1": limits.l1, "nvme": limits.nvme}
        self._maps.set_key(
            admission.pool,
            admission.pool.tenants_name,
            admission.tenant_id,
            TenantEntry((digest_token(token),), limits, who.ref).encode(),
        )
        if status.get("quota") != ceiling or previous_id != admission.tenant_id:
            self._maps.set_key(
                admission.pool,
                admission.pool.quotas_name,
                admission.tenant_id,
                quota_to_configmap(limits),
            )
        self._spaces.publish(admission.pool, admission.pool_spec)
        self.publish_pool_tokens(admission.pool, index=admission.pool_spec.index.enabled)
        pool = f"{admission.pool.namespace}/{admission.pool.name}"
        ready: Assessment = (
            (True, TOKEN_PUBLISHED, f"the token and quota are published to the agents of {pool}")
            if admission.pool_ready
            else (False, POOL_NOT_READY, f"the pool {pool} is not ready")
        )
        accepted: Assessment = (True, ACCEPTED, f"the pool {pool} admits the tenant")
        spaces = sorted(name for name in map(space_of, handed) if name is not None)
        changed = self._write_status(
            tenant,
            accepted,
            ready,
            tenantId=admission.tenant_id,
            secretName=who.secret_name,
            tokenGeneration=spec.token_generation,
            quota=ceiling,
            sharedSpaces=spaces or None,
        )
        if changed[ACCEPTED]:
            self._events.accepted(tenant, f"{accepted[2]}: tenant id {admission.tenant_id}")
        if rotated:
            self._events.token_rotated(tenant, spec.token_generation)
        self._spaces_changed(tenant, spaces, pool)

    def _admit(self, who: _Tenant, spec: TenantSpec) -> Admission:
        ref = spec.pool_ref
        pool_body = self._cluster.get(POOLS, ref.namespace, ref.name)
        if pool_body is None or pool_body["metadata"].get("deletionTimestamp"):
            raise Refused(POOL_NOT_FOUND, f"there is no KVCachePool {ref.namespace}/{ref.name}")
        try:
            pool_spec = PoolSpec.parse(pool_body.get("spec") or {})
        except InvalidSpec as error:
            raise Refused(POOL_NOT_FOUND, f"the pool's spec is invalid: {error}") from error
        pool = Pool(ref.name, ref.namespace, pool_body["metadata"]["uid"])
        labels = self._cluster.namespace_labels(who.namespace) or {}
        if not _admits(pool_spec.tenants.allowed_namespaces, labels):
            raise Refused(
                NAMESPACE_NOT_ALLOWED,
                f"the pool {ref.namespace}/{ref.name} does not admit the namespace "
                f"{who.namespace} (its spec.tenants.allowedNamespaces does not select it)",
            )
        _within_maximum(spec, pool_spec)
        secret = self._cluster.get(SECRETS, who.namespace, who.secret_name)
        salt, generated = self._salt(who, spec, secret)
        tenant = tenant_id(salt)
        holder = _holder(self._maps.data(pool, pool.tenants_name) or {}, tenant)
        if holder is not None and holder != who.ref:
            raise Refused(
                TENANT_ID_IN_USE,
                f"the KVCacheTenant {holder} already has tenant id {tenant} in this pool "
                "(the same salt): use a salt of your own",
            )
        conditions = (pool_body.get("status") or {}).get("conditions") or ()
        ready = any(c.get("type") == READY and c.get("status") == "True" for c in conditions)
        return Admission(pool, pool_spec, ready, salt, generated, tenant, secret)

    def _salt(
        self, who: _Tenant, spec: TenantSpec, secret: Mapping[str, Any] | None
    ) -> tuple[str, bool]:
        """The tenant's salt, and whether the operator generated it."""
        ref = spec.salt_secret_ref
        if ref is None:
            return decoded(secret).get(SALT_KEY) or mint(), True
        theirs = self._cluster.get(SECRETS, who.namespace, ref.name)
        values = decoded(theirs)
        if ref.key not in values:
            missing = "does not exist" if theirs is None else f"has no key {ref.key}"
            raise Refused(
                SALT_SECRET_MISSING, f"the Secret {ref.name} {missing} (spec.saltSecretRef)"
            )
        if not values[ref.key]:
            raise Refused(INVALID_SALT, f"the key {ref.key} of the Secret {ref.name} is empty")
        return values[ref.key], False

    def _write_secret(
        self, who: _Tenant, spec: TenantSpec, admission: Admission, handed: Mapping[str, str]
    ) -> tuple[str, bool]:
        """Make the tenant's Secret hold what it should (``handed``: the salts of the shared
        spaces that admit it, by key); returns its token and whether an earlier token was
        replaced (a rotation)."""
        existing = admission.secret
        current = decoded(existing)
        annotations = (existing or {}).get("metadata", {}).get("annotations") or {}
        minted_for = annotations.get(TOKEN_GENERATION_ANNOTATION)
        token = current.get(TOKEN_KEY)
        rotated = token is not None and minted_for != str(spec.token_generation)
        if token is None or rotated:
            token = mint()
        pool = admission.pool
        desired: dict[str, str | None] = {
            TOKEN_KEY: token,
            TENANT_ID_KEY: admission.tenant_id,
            POOL_KEY: pool.name,
            NAMESPACE_KEY: pool.namespace,
            ENDPOINT_KEY: (
                f"http://{pool.service_name}.{pool.namespace}.svc:{admission.pool_spec.ports.http}"
            ),
            SALT_KEY: admission.salt if admission.generated else None,
            **handout_changes(current, handed),
        }
        generation = {TOKEN_GENERATION_ANNOTATION: str(spec.token_generation)}
        if existing is None:
            self._cluster.create(SECRETS, _secret(who, desired, generation))
        else:
            changes = {key: value for key, value in desired.items() if current.get(key) != value}
            if changes or minted_for != generation[TOKEN_GENERATION_ANNOTATION]:
                self._cluster.patch(
                    SECRETS,
                    who.namespace,
                    who.secret_name,
                    {"metadata": {"annotations": generation}, "data": encoded(changes)},
                )
        return token, rotated

    def _refuse(self, tenant: Mapping[str, Any], spec: TenantSpec | None, refusal: Refused) -> None:
        """Take back what a refused tenant had: its entry in the pool (and so its places in
        the pool's shared spaces), its Secret's token and the spaces' salts."""
        who = _Tenant.of(tenant)
        previous_id = (tenant.get("status") or {}).get("tenantId")
        where = "its pool"
        if spec is not None and previous_id:
            ref = spec.pool_ref
            where = f"{ref.namespace}/{ref.name}"
            pool = self._cluster.get(POOLS, ref.namespace, ref.name)
            if pool is not None:
                identity = Pool(ref.name, ref.namespace, pool["metadata"]["uid"])
                self._withdraw_entry(identity, previous_id, who, drop_quota=False)
                self._republish_spaces(identity, pool)
        current = decoded(self._cluster.get(SECRETS, who.namespace, who.secret_name))
        withdrawn: dict[str, str | None] = {key: None for key in (TOKEN_KEY,) if key in current}
        withdrawn |= handout_changes(current, {})
        if withdrawn:
            self._cluster.patch(SECRETS, who.namespace, who.secret_name, {"data": withdrawn})
        changed = self._write_status(
            tenant,
            (False, refusal.reason, refusal.message),
            (False, NOT_ACCEPTED, f"not accepted: {refusal.message}"),
            sharedSpaces=None,
        )
        if changed[ACCEPTED]:
            self._events.refused(tenant, refusal.reason, refusal.message)
        self._spaces_changed(tenant, [], where)

    def _spaces_changed(self, tenant: Mapping[str, Any], spaces: list[str], pool: str) -> None:
        """Events for the shared spaces the tenant was admitted to or revoked from."""
        before = set((tenant.get("status") or {}).get("sharedSpaces") or ())
        added, removed = sorted(set(spaces) - before), sorted(before - set(spaces))
        if added:
            secret = _Tenant.of(tenant).secret_name
            self._events.space_admitted(
                tenant,
                f"admitted to the shared spaces {', '.join(added)} of {pool}: the Secret "
                f"{secret} holds their salts at {', '.join(map(salt_key, added))}",
            )
        if removed:
            self._events.space_revoked(
                tenant,
                f"revoked from the shared spaces {', '.join(removed)} of {pool}: the agents "
                "drop the tenant from them on their next watch event",
            )

    def _republish_spaces(self, pool: Pool, body: Mapping[str, Any]) -> None:
        """The pool's shared spaces after a tenant's entry left (their members follow)."""
        try:
            spec = PoolSpec.parse(body.get("spec") or {})
        except InvalidSpec:
            return  # the pool's reconcile reports it; the tenant's token is revoked anyway
        self._spaces.publish(pool, spec)

    def _write_status(
        self,
        tenant: Mapping[str, Any],
        accepted: Assessment,
        ready: Assessment,
        **fields: Any,
    ) -> dict[str, bool]:
        """Write the conditions and ``fields``; says which conditions changed (status or
        reason), so that an event is posted once per change, not once per re-check."""
        who = _Tenant.of(tenant)
        previous = tenant.get("status") or {}
        earlier = {c.get("type"): c for c in previous.get("conditions", ())}
        now = datetime.now(UTC)
        conditions = [
            condition(kind, value, who.generation, earlier.get(kind), now)
            for kind, value in ((ACCEPTED, accepted), (READY, ready))
        ]
        status = {"observedGeneration": who.generation, "conditions": conditions, **fields}
        if {key: previous.get(key) for key in status} != status:
            self._cluster.patch_status(TENANTS, who.namespace, who.name, status)
        return {
            new["type"]: (earlier.get(new["type"]) or {}).get("status") != new["status"]
            or (earlier.get(new["type"]) or {}).get("reason") != new["reason"]
            for new in conditions
        }

    # ------------------------------------------------------------ deletion

    def tenant_deleted(self, tenant: Mapping[str, Any], *, last_attempt: bool) -> None:
        """Revoke the token, clear the chunks on every agent, drop the quota. Raises
        :class:`AgentsUnreachable` where agents failed, unless ``last_attempt``."""
        who = _Tenant.of(tenant)
        status = tenant.get("status") or {}
        tenant_id_ = status.get("tenantId")
        if not tenant_id_ or status.get("quota") is None:
            return  # never accepted: nothing was published under its name
        try:
            spec = TenantSpec.parse(tenant.get("spec") or {})
        except InvalidSpec:
            return
        ref = spec.pool_ref
        pool_body = self._cluster.get(POOLS, ref.namespace, ref.name)
        if pool_body is None:
            return  # the pool is gone, and with it its ConfigMaps and agents
        pool = Pool(ref.name, ref.namespace, pool_body["metadata"]["uid"])
        with self._lock:
            revoked = self._withdraw_entry(pool, tenant_id_, who, drop_quota=False)
            self._republish_spaces(pool, pool_body)
        where = f"{ref.namespace}/{ref.name}"
        if revoked:
            self._events.revoked(
                tenant, f"revoked the token on every agent of {where} (their next watch event)"
            )
        try:
            port = PoolSpec.parse(pool_body.get("spec") or {}).ports.http
        except InvalidSpec:
            port = PoolSpec().ports.http
        sweep = self._agents.clear(pool, port, tenant_id_)
        if sweep.failed and not last_attempt:
            raise AgentsUnreachable("; ".join(sweep.failed))
        if sweep.failed:
            self._events.clear_incomplete(
                tenant,
                f"{len(sweep.failed)} agents of {where} did not clear the tenant's chunks "
                f"(their L1 chunks age out by eviction): {'; '.join(sweep.failed)}",
            )
        with self._lock:
            self._maps.set_key(pool, pool.quotas_name, tenant_id_, None)
        chunks = sum(answer.dropped_chunks for answer in sweep.answers)
        objects = sum(answer.l2_dropped_objects or 0 for answer in sweep.answers)
        self._events.revoked(
            tenant,
            f"freed the tenant's space: {chunks} chunks dropped from L1 and {objects} objects "
            f"from L2 by {len(sweep.answers)} agents of {where}; its quota is dropped",
        )

    # ---------------------------------------------------------------- usage

    def recheck(self, namespace: str, name: str) -> None:
        """The periodic pass: admission again, then usage, of the tenant as stored now. The
        pass runs in a thread that may outlive its daemon (kopf cannot cancel a thread), so it
        takes names, never the body the daemon started with: from such a body, a pass that
        went on after the deletion published the deleted tenant's token again."""
        tenant = self.refresh(namespace, name)
        if tenant is not None:
            self.read_usage(tenant)

    def read_usage(self, tenant: Mapping[str, Any]) -> None:
        status = tenant.get("status") or {}
        earlier = {c.get("type"): c for c in status.get("conditions", ())}
        tenant_id_ = status.get("tenantId")
        if not tenant_id_ or (earlier.get(ACCEPTED) or {}).get("status") != "True":
            return
        spec = TenantSpec.parse(tenant.get("spec") or {})
        ref = spec.pool_ref
        pool_body = self._cluster.get(POOLS, ref.namespace, ref.name)
        if pool_body is None:
            return
        pool = Pool(ref.name, ref.namespace, pool_body["metadata"]["uid"])
        port = PoolSpec.parse(pool_body.get("spec") or {}).ports.http
        sweep = self._agents.usage(pool, port, tenant_id_)
        if sweep.failed:
            log.warning("usage of tenant %s: %s", tenant_id_, "; ".join(sweep.failed))
        usage = usage_summary(sweep.answers)
        who = _Tenant.of(tenant)
        self._cluster.patch_status(TENANTS, who.namespace, who.name, {"usage": usage})

    # ----------------------------------------------------- the pool's side

    def publish_pool_tokens(self, pool: Pool, *, index: bool) -> None:
        """In the pool's tenants ConfigMap: the digest of the operator's admin token under
        ``operator`` (replacing a previous operator's) and, with ``index``, of the token the
        pool's index follows its agents with under ``index`` (minted into the Secret the
        index mounts, once: it outlives operator restarts); without, no ``index`` key, so a
        token left in that Secret works no more."""
        data = self._maps.data(pool, pool.tenants_name)
        if data is None:
            return  # the pool's reconcile makes it; this runs again after
        operator = encode_role_entry((self._token.digest,))
        self._maps.patch_key(pool, pool.tenants_name, data, OPERATOR_KEY, operator)
        indexes = encode_role_entry((digest_token(self._index_token(pool)),)) if index else None
        self._maps.patch_key(pool, pool.tenants_name, data, INDEX_KEY, indexes)

    def _index_token(self, pool: Pool) -> str:
        """The index's token for the agents, from its Secret (made with a new one if absent:
        owned by the pool, deleted with it)."""
        name = pool.index_access_name
        found = self._cluster.get(SECRETS, pool.namespace, name)
        token = decoded(found).get(AGENT_ACCESS_KEY)
        if token is None:
            token = mint()
            owner = manifest("v1", "Secret", pool, name, component=INDEX_COMPONENT)
            secret = {**owner, "type": "Opaque", "data": encoded({AGENT_ACCESS_KEY: token})}
            if found is None:
                self._cluster.create(SECRETS, secret)
            else:
                self._cluster.patch(SECRETS, pool.namespace, name, secret)
        return token

    # -------------------------------------------------------------- helpers

    def _withdraw_entry(self, pool: Pool, tenant: str, who: _Tenant, *, drop_quota: bool) -> bool:
        """Remove the tenant's entry (and quota) if it is this tenant's; says if it was."""
        if _holder(self._maps.data(pool, pool.tenants_name) or {}, tenant) != who.ref:
            return False
        self._maps.set_key(pool, pool.tenants_name, tenant, None)
        if drop_quota:
            self._maps.set_key(pool, pool.quotas_name, tenant, None)
        return True


def _admits(selector: LabelSelector | None, labels: Mapping[str, str]) -> bool:
    """Absent or empty selects no namespace (unlike Kubernetes' empty selector)."""
    return selector is not None and selector != LabelSelector() and selector.matches(labels)


def _within_maximum(spec: TenantSpec, pool_spec: PoolSpec) -> None:
    maximum = pool_spec.tenants.max_quota
    for tier, asked, most in (
        ("l1", spec.quota.l1, maximum.l1),
        ("nvme", spec.quota.nvme_bytes, maximum.nvme),
    ):
        if most is not None and asked > most:
            raise Refused(
                QUOTA_ABOVE_MAXIMUM,
                f"quota.{tier} {format_bytes(asked)} is above the pool's maximum "
                f"{format_bytes(most)} (spec.tenants.maxQuota.{tier})",
            )


def _holder(data: Mapping[str, str], tenant: str) -> str | None:
    """Which KVCacheTenant (namespace/name) an entry of the tenants ConfigMap is for."""
    if tenant not in data:
        return None
    try:
        return TenantEntry.decode(data[tenant]).source
    except ValueError:
        return None


def _secret(
    who: _Tenant, values: Mapping[str, str | None], annotations: dict[str, str]
) -> dict[str, Any]:
    """The tenant's Secret, owned by the KVCacheTenant (deleted with it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": who.secret_name,
            "namespace": who.namespace,
            "labels": {MANAGED_BY_LABEL: OPERATOR},
            "annotations": annotations,
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": TENANT_KIND,
                    "name": who.name,
                    "uid": who.uid,
                    "controller": True,
                }
            ],
        },
        "data": {key: value for key, value in encoded(values).items() if value is not None},
    }
