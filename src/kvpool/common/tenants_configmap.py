"""The pool's tenants ConfigMap: token digests and quota ceilings of its KVCacheTenants.

The operator writes the ConfigMap (``kvpool-<pool>-tenants``), one key per tenant with
JSON merge patches; the agents only read it, with a list and a watch
(:class:`~kvpool.agent.tenancy.tenants_watch.TenantsWatch`). This module is its one
codec, used by the writer and the readers. Its ``data``:

- ``<tenant id>``: ``{"tokens": ["<sha256 hex>", ...], "ceiling": {"l1": <bytes or null>,
  "nvme": <bytes or null>}, "tenant": "<namespace>/<name>"}``: the tenant's bearer tokens
  (digests only) and the most it may set as its own quota per tier (null: no ceiling);
- ``space.<tenant id>``: ``{"space": "<namespace>/<pool>/<name>", "members": ["<tenant id>",
  ...], "owners": ["<tenant id>", ...], "pinBudget": <bytes>}``: a shared space of the pool
  (the key's tenant id is its salt's): the tenants whose tokens may also act for it (read,
  store and load its chunks), those that may also pin and warm its chunks, and the most of
  L1 its pinned chunks may hold. Its quota is in the quotas ConfigMap, as any tenant's;
- ``operator``: ``{"tokens": ["<sha256 hex>"]}``: the operator's admin token;
- ``index``: ``{"tokens": ["<sha256 hex>"]}``: the token the pool's prefix index follows
  the agents with (snapshots and chunk events only), minted by the operator.

:func:`parse_tenants` reads a whole ``data`` into a :class:`TenantsSnapshot`. A malformed
entry is logged by key and reason, never by value (a value holds token digests), and
skipped; the rest apply.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kvpool.common.keys import is_tenant_id
from kvpool.common.quotas import TierLimits, as_limits, quota_from_json

log = logging.getLogger(__name__)

OPERATOR_KEY = "operator"
INDEX_KEY = "index"
SPACE_KEY_PREFIX = "space."
_DIGEST = re.compile(r"[0-9a-f]{64}")


def digest_token(token: str) -> bytes:
    """SHA-256 of a bearer token's UTF-8 bytes: all that agents keep of a token."""
    return hashlib.sha256(token.encode()).digest()


def token_digest(token: str) -> str:
    """What the tenants ConfigMap holds of a token: :func:`digest_token` as hex."""
    return digest_token(token).hex()


@dataclass(frozen=True, slots=True)
class TenantEntry:
    tokens: tuple[bytes, ...]
    """SHA-256 digests of the tenant's bearer tokens."""
    ceiling: TierLimits
    """The most the tenant may set as its own quota, per tier (None: no ceiling)."""
    source: str
    """The KVCacheTenant that made the entry (``namespace/name``), for logs."""

    def encode(self) -> str:
        """The ConfigMap value of this entry."""
        ceiling = {"l1": self.ceiling.l1, "nvme": self.ceiling.nvme}
        tokens = [token.hex() for token in self.tokens]
        return json.dumps(
            {"tokens": tokens, "ceiling": ceiling, "tenant": self.source}, sort_keys=True
        )

    @classmethod
    def decode(cls, value: str) -> TenantEntry:
        """Parse a tenant's ConfigMap value; ValueError naming the field if malformed."""
        entry = _object(value, {"tokens", "ceiling", "tenant"})
        source = entry.get("tenant", "")
        if not isinstance(source, str):
            raise ValueError("'tenant' is not a string")
        try:
            ceiling = as_limits(quota_from_json(entry.get("ceiling")))
        except ValueError as error:
            raise ValueError(f"'ceiling': {error}") from None
        return cls(_digests(entry.get("tokens")), ceiling, source)


def space_key(space: str) -> str:
    """The ConfigMap key of the shared space whose tenant id is ``space``."""
    return SPACE_KEY_PREFIX + space


@dataclass(frozen=True, slots=True)
class SpaceEntry:
    """A shared space: who may use it, who may pin in it, how much of L1 its pins may hold."""

    source: str
    """The space as ``namespace/pool/name``, for logs and usage."""
    members: frozenset[str] = frozenset()
    """Tenant ids whose tokens may act for the space's chunks."""
    owners: frozenset[str] = frozenset()
    """Tenant ids whose tokens may also pin and warm the space's chunks."""
    pin_budget: int = 0
    """Bytes of L1 the space's pinned chunks may hold (0: none may be pinned)."""

    def encode(self) -> str:
        return json.dumps(
            {
                "space": self.source,
                "members": sorted(self.members),
                "owners": sorted(self.owners),
                "pinBudget": self.pin_budget,
            },
            sort_keys=True,
        )

    @classmethod
    def decode(cls, value: str) -> SpaceEntry:
        """Parse a space's ConfigMap value; ValueError naming the field if malformed."""
        entry = _object(value, {"space", "members", "owners", "pinBudget"})
        source = entry.get("space", "")
        if not isinstance(source, str):
            raise ValueError("'space' is not a string")
        budget = entry.get("pinBudget", 0)
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError("'pinBudget' must be a byte count (0 or more)")
        return cls(source, _tenant_ids(entry, "members"), _tenant_ids(entry, "owners"), budget)


def encode_role_entry(tokens: tuple[bytes, ...]) -> str:
    """The value of the ``operator`` or ``index`` key: the digests of that role's tokens."""
    return json.dumps({"tokens": [token.hex() for token in tokens]})


def decode_role_entry(value: str) -> tuple[bytes, ...]:
    return _digests(_object(value, {"tokens"}).get("tokens"))


@dataclass(frozen=True, slots=True)
class TenantsSnapshot:
    tenants: dict[str, TenantEntry] = field(default_factory=dict)
    spaces: dict[str, SpaceEntry] = field(default_factory=dict)
    """Shared spaces by their tenant id."""
    operator_tokens: tuple[bytes, ...] = ()
    index_tokens: tuple[bytes, ...] = ()

    def ceilings(self) -> dict[str, TierLimits]:
        return {tenant: entry.ceiling for tenant, entry in self.tenants.items()}


def parse_tenants(data: Mapping[str, str], where: str) -> TenantsSnapshot:
    """The snapshot of a ConfigMap's ``data``; malformed entries are logged and skipped."""
    snapshot = TenantsSnapshot()
    for key, value in data.items():
        try:
            if key == OPERATOR_KEY:
                snapshot = replace(snapshot, operator_tokens=decode_role_entry(value))
            elif key == INDEX_KEY:
                snapshot = replace(snapshot, index_tokens=decode_role_entry(value))
            elif is_tenant_id(key):
                snapshot.tenants[key] = TenantEntry.decode(value)
            elif key.startswith(SPACE_KEY_PREFIX) and is_tenant_id(key[len(SPACE_KEY_PREFIX) :]):
                snapshot.spaces[key[len(SPACE_KEY_PREFIX) :]] = SpaceEntry.decode(value)
            else:
                raise ValueError(
                    "the key is neither a tenant id, 'space.<tenant id>', 'operator' nor 'index'"
                )
        except ValueError as error:
            log.error("%s: entry %s skipped: %s", where, _key_glimpse(key), error)
    return snapshot


def _object(value: str, keys: set[str]) -> dict[str, object]:
    try:
        entry = json.loads(value)
    except ValueError:
        raise ValueError("not JSON") from None  # the decoder's message quotes the value
    if not isinstance(entry, dict):
        raise ValueError(f"expected a JSON object, got {type(entry).__name__}")
    unknown = set(entry) - keys
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; expected {sorted(keys)}")
    return entry


def _digests(value: object) -> tuple[bytes, ...]:
    if not isinstance(value, list):
        raise ValueError("'tokens' must be a list of SHA-256 hex digests")
    for position, item in enumerate(value, start=1):
        if not isinstance(item, str) or not _DIGEST.fullmatch(item):
            raise ValueError(f"token #{position} is not a SHA-256 digest (64 lowercase hex)")
    return tuple(bytes.fromhex(item) for item in value)


def _tenant_ids(entry: Mapping[str, object], name: str) -> frozenset[str]:
    value = entry.get(name, [])
    if not isinstance(value, list) or not all(
        isinstance(item, str) and is_tenant_id(item) for item in value
    ):
        raise ValueError(f"'{name}' must be a list of tenant ids")
    return frozenset(value)


def _key_glimpse(key: str) -> str:
    """A key, quoted only when it has the shape of a key (tenant id, 'operator')."""
    if key in (OPERATOR_KEY, INDEX_KEY) or is_tenant_id(key.removeprefix(SPACE_KEY_PREFIX)):
        return key
    return f"{key[:2]!r}... ({len(key)} characters)"
