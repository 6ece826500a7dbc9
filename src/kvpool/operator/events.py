"""Events on a KVCachePool (``kubectl describe kvp``) and a KVCacheTenant (``kubectl describe
kvt``): what the operator did and what failed. None carries a salt or a token.

kopf posts them (queued, in the background, with retries).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import kopf

from kvpool.operator.reasons import (
    ACCEPTED,
    APPLIED,
    APPLY_FAILED,
    CLEAR_INCOMPLETE,
    DRIFT_CORRECTED,
    INVALID_SPEC,
    PEER_KEYS_ROTATED,
    REVOKED,
    SPACE_ADMITTED,
    SPACE_CREATED,
    SPACE_REMOVED,
    SPACE_REVOKED,
    TOKEN_ROTATED,
    unavailable,
)


class PoolEvents:
    """The events the operator posts on a pool."""

    def applied(self, pool: Mapping[str, Any], changes: Sequence[str]) -> None:
        _post(pool, "Normal", APPLIED, "; ".join(changes))

    def drift_corrected(self, pool: Mapping[str, Any], child: str, deleted: bool) -> None:
        how = "deleted" if deleted else "changed"
        _post(pool, "Normal", DRIFT_CORRECTED, f"restored {child}, {how} outside the operator")

    def invalid_spec(self, pool: Mapping[str, Any], message: str) -> None:
        _post(pool, "Warning", INVALID_SPEC, message)

    def apply_failed(self, pool: Mapping[str, Any], message: str) -> None:
        _post(pool, "Warning", APPLY_FAILED, f"{message} (retrying)")

    def kind_unavailable(
        self, pool: Mapping[str, Any], kind: str, name: str, provided_by: str
    ) -> None:
        """The spec asks for a child of a kind the cluster does not serve (reason
        ``<Kind>Unavailable``, e.g. ``ServiceMonitorUnavailable``)."""
        _post(
            pool,
            "Warning",
            unavailable(kind),
            f"the pool asks for the {kind} {name} but the cluster has no {kind} resource "
            f"(install {provided_by}); no {kind} was made",
        )

    def peer_keys_rotated(self, pool: Mapping[str, Any], message: str) -> None:
        _post(pool, "Normal", PEER_KEYS_ROTATED, message)

    def space_created(self, pool: Mapping[str, Any], message: str) -> None:
        _post(pool, "Normal", SPACE_CREATED, message)

    def space_removed(self, pool: Mapping[str, Any], message: str) -> None:
        _post(pool, "Normal", SPACE_REMOVED, message)


def _post(pool: Mapping[str, Any], type: str, reason: str, message: str) -> None:
    kopf.event(kopf.Body(cast(kopf.RawBody, pool)), type=type, reason=reason, message=message)


class TenantEvents:
    """The events the operator posts on a KVCacheTenant (``kubectl describe kvt``). None
    carries the salt or a token."""

    def accepted(self, tenant: Mapping[str, Any], message: str) -> None:
        _post(tenant, "Normal", ACCEPTED, message)

    def refused(self, tenant: Mapping[str, Any], reason: str, message: str) -> None:
        _post(tenant, "Warning", reason, message)

    def token_rotated(self, tenant: Mapping[str, Any], generation: int) -> None:
        message = f"minted the token of generation {generation}; the previous one is revoked"
        _post(tenant, "Normal", TOKEN_ROTATED, message)

    def revoked(self, tenant: Mapping[str, Any], message: str) -> None:
        _post(tenant, "Normal", REVOKED, message)

    def clear_incomplete(self, tenant: Mapping[str, Any], message: str) -> None:
        _post(tenant, "Warning", CLEAR_INCOMPLETE, message)

    def space_admitted(self, tenant: Mapping[str, Any], message: str) -> None:
        _post(tenant, "Normal", SPACE_ADMITTED, message)

    def space_revoked(self, tenant: Mapping[str, Any], message: str) -> None:
        _post(tenant, "Normal", SPACE_REVOKED, message)
