"""The KVCacheTenant resource: a team's binding to a pool, made in the team's namespace."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, ValidationError

from kvpool.operator.reasons import READY
from kvpool.operator.spec.base import (
    TENANT_KIND,
    TENANT_PLURAL,
    Bytes,
    Int64,
    InvalidSpec,
    Resource,
    SpecModel,
    describe,
)
from kvpool.operator.spec.markers import AGE, CustomResource, PrinterColumn, Rule, cel
from kvpool.operator.spec.status import TenantStatus

DNS_LABEL = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class PoolRef(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "self == oldSelf",
                "poolRef cannot change; delete the KVCacheTenant and create it again",
            )
        )
    )

    name: str = Field(
        description="The pool's name.",
        json_schema_extra={"maxLength": 40}
        | cel(
            Rule(
                f"self.matches('{DNS_LABEL}')",
                "poolRef.name must be a pool name: a DNS label (lowercase letters, digits, "
                "'-') of at most 40 characters",
            )
        ),
    )
    namespace: str = Field(
        description="The pool's namespace.",
        json_schema_extra={"maxLength": 63}
        | cel(
            Rule(
                f"self.matches('{DNS_LABEL}')",
                "poolRef.namespace must be a namespace name: a DNS label (lowercase letters, "
                "digits, '-') of at most 63 characters",
            )
        ),
    )


class TenantQuota(SpecModel):
    l1: Bytes = Field(
        description="Bytes of L1 (shared memory) on each node, e.g. 8Gi.",
        json_schema_extra=cel(
            Rule(
                "quantity(self).asInteger() > 0",
                "quota.l1 must be more than 0 bytes: a tenant without L1 space caches nothing",
            )
        ),
    )
    nvme: Bytes | None = Field(
        None, description="Bytes of each node's NVMe tier (0: none). Absent: the same as l1."
    )

    @property
    def nvme_bytes(self) -> int:
        return self.l1 if self.nvme is None else self.nvme


class SaltSecretRef(SpecModel):
    name: str = Field(
        description="Name of the Secret, in the tenant's namespace.",
        json_schema_extra={"maxLength": 253}
        | cel(
            Rule(
                "self.matches('^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$')",
                "saltSecretRef.name must be a Secret name (a DNS subdomain)",
            )
        ),
    )
    key: str = Field(
        "salt",
        description="Key of the Secret that holds the salt.",
        json_schema_extra={"maxLength": 253}
        | cel(
            Rule(
                "self.matches('^[-._a-zA-Z0-9]+$')",
                "saltSecretRef.key must be a Secret key (letters, digits, '-', '_', '.')",
            )
        ),
    )


class TenantSpec(SpecModel):
    """A KVCacheTenant's ``spec``."""

    pool_ref: PoolRef = Field(
        description="The KVCachePool to bind to; its spec.tenants.allowedNamespaces must "
        "select this namespace. Fixed once set (delete and recreate the tenant to move it)."
    )
    quota: TenantQuota = Field(
        description="The tenant's quota ceiling per tier, on each node. The operator writes it "
        "as the tenant's quota whenever it changes; in between, the tenant's token may set a "
        "lower or equal quota over the agents' HTTP API."
    )
    salt_secret_ref: SaltSecretRef | None = Field(
        None,
        description="The team's own Secret, in this namespace, holding the salt its engines "
        "put in cache_salt. Absent: the operator generates a strong random salt into the "
        "Secret <name>-kvpool.",
    )
    token_generation: Int64 = Field(
        0,
        ge=0,
        description="Change it (bump it) to rotate the tenant's token: the operator mints a "
        "new one into the Secret and the old one stops working on every agent within seconds.",
    )

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> TenantSpec:
        """Read a tenant's ``spec``; :class:`InvalidSpec` says which fields are wrong."""
        try:
            return cls.model_validate(spec)
        except ValidationError as error:
            raise InvalidSpec(describe(error, "spec")) from error


class KVCacheTenant(Resource):
    """A team's space in a KVCachePool: the operator computes its tenant id from its salt,
    mints its bearer token into the Secret <name>-kvpool beside it, and hands the pool's
    agents the token's hash and the quota."""

    crd: ClassVar[CustomResource] = CustomResource(
        kind=TENANT_KIND,
        plural=TENANT_PLURAL,
        short_names=("kvt",),
        printer_columns=(
            PrinterColumn("Pool", "string", ".spec.poolRef.name", "The pool the tenant binds to."),
            PrinterColumn(
                "Tenant-ID",
                "string",
                ".status.tenantId",
                "The tenant id the agents know the team by (from its salt).",
            ),
            PrinterColumn(
                "L1-Quota", "string", ".spec.quota.l1", "The tenant's L1 ceiling on each node."
            ),
            PrinterColumn(
                "L1-Used",
                "integer",
                ".status.usage.l1Bytes",
                "Bytes of L1 the tenant uses, summed over the pool's agents.",
            ),
            PrinterColumn(
                "Ready",
                "string",
                f'.status.conditions[?(@.type=="{READY}")].status',
                "Whether the tenant's token and quota are on the pool's agents.",
            ),
            AGE,
        ),
    )

    spec: TenantSpec = Field(description="Desired state of the tenant.")
    status: TenantStatus | None = Field(
        None, description="What the operator did with the tenant, and its usage."
    )
