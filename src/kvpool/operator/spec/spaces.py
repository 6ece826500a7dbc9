"""A pool's shared spaces (``spec.sharedSpaces``): caches that the tenants it admits share.

A space has a salt of its own (the operator mints it) and, for the agents, a tenant id of
its own, with its own quota. The KVCacheTenants of the pool in its ``allowedNamespaces``
get the salt in their Secrets and act for its chunks with their own tokens; those in
``owners`` may also pin and warm them. ``pinned`` prefixes are the platform's: the operator
keeps them pinned (and warm) on every agent.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from kvpool.operator.spec.base import Bytes, SpecModel
from kvpool.operator.spec.markers import SET, Rule, cel, list_map
from kvpool.operator.spec.tenant import DNS_LABEL, TenantQuota

MAX_TOKEN_ID = (1 << 32) - 1
"""Keys pack each token id as a uint32."""
OWNERS_ALLOWED = "owners must each be in allowedNamespaces"
PINS_NEED_BUDGET = "pinned needs a pinBudget above 0: the agents pin nothing without one"

NamespaceName = Annotated[str, Field(pattern=DNS_LABEL, max_length=63)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class PinnedPrefix(SpecModel):
    name: str = Field(
        pattern=DNS_LABEL,
        max_length=63,
        description="The pin's name on the agents (a DNS label).",
    )
    tokens: tuple[TokenId, ...] = Field(
        min_length=1,
        max_length=65536,
        description="The prefix's token ids, as the model's tokenizer gives them; only its "
        "full chunks are pinned.",
    )
    warm: bool = Field(
        True,
        description="Also have every agent load the prefix's chunks into L1 (from its L2 "
        "tiers), not only keep them there once stored.",
    )


class SharedSpaceSpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "!has(self.owners) || self.owners.all(o, has(self.allowedNamespaces) && "
                "o in self.allowedNamespaces)",
                f"sharedSpaces[].{OWNERS_ALLOWED}",
            ),
            Rule(
                "!has(self.pinned) || self.pinned.size() == 0 || "
                "quantity(self.pinBudget).asInteger() > 0",
                f"sharedSpaces[].{PINS_NEED_BUDGET}",
            ),
        )
    )

    name: str = Field(
        pattern=DNS_LABEL,
        max_length=63,
        description="The space's name (a DNS label, unique in the pool): an admitted tenant's "
        "Secret holds its salt at the key space-<name>.",
    )
    quota: TenantQuota = Field(
        description="The space's own quota per tier, on each node, as a tenant's: what its "
        "chunks may hold, whichever member stored them."
    )
    pin_budget: Bytes = Field(
        "0",
        validate_default=True,
        description="Bytes of L1 on each node that the space's pinned chunks may hold (0: none "
        "may be pinned).",
    )
    allowed_namespaces: tuple[NamespaceName, ...] = Field(
        (),
        description="Namespaces (by name) whose KVCacheTenants of this pool are admitted to the "
        "space: each accepted one gets its salt. Removing a namespace revokes them.",
        json_schema_extra={"maxItems": 256} | SET,
    )
    owners: tuple[NamespaceName, ...] = Field(
        (),
        description="Namespaces, each also in allowedNamespaces, whose tenants may also pin "
        "and warm the space's chunks.",
        json_schema_extra={"maxItems": 256} | SET,
    )
    pinned: tuple[PinnedPrefix, ...] = Field(
        (),
        description="Prefixes the operator keeps pinned (and warm) on every agent, keyed for "
        "every tensor-parallel rank of spec.index.fingerprint (required with pinned).",
        json_schema_extra={"maxItems": 64} | list_map("name"),
    )

    @field_validator("owners")
    @classmethod
    def _owners_are_allowed(cls, owners: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        allowed = info.data.get("allowed_namespaces", ())
        strangers = [owner for owner in owners if owner not in allowed]
        if strangers:
            raise ValueError(f"{OWNERS_ALLOWED}; {', '.join(strangers)} is not")
        return owners

    @field_validator("pinned")
    @classmethod
    def _pins_are_unique_and_have_a_budget(
        cls, pinned: tuple[PinnedPrefix, ...], info: ValidationInfo
    ) -> tuple[PinnedPrefix, ...]:
        unique_names([pin.name for pin in pinned])
        if pinned and not info.data.get("pin_budget"):
            raise ValueError(PINS_NEED_BUDGET)
        return pinned


def unique_names(names: list[str]) -> None:
    """ValueError naming the names given more than once."""
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"names must be unique; {', '.join(twice)} is given more than once")
