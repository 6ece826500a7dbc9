"""The words the operator writes into statuses and events, defined once: the types of the
conditions and the CamelCase reasons of conditions and events (``docs/platform/pools.md`` lists
the tenant's; ``kvpool.operator.status`` says when a pool's apply)."""

from __future__ import annotations

# Condition types: a pool's Ready, Progressing, Degraded and SharedSpaces; a tenant's
# Accepted and Ready.
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
SHARED_SPACES = "SharedSpaces"
"""A pool's condition while it declares shared spaces (``kvpool.operator.spaces``)."""
ACCEPTED = "Accepted"
"""A tenant's condition type, the reason it holds for, and the event that says so."""

# A pool's condition reasons
AGENTS_READY = "AgentsReady"
AGENTS_NOT_READY = "AgentsNotReady"
NO_NODES = "NoNodes"
PENDING = "Pending"
RECONCILING = "Reconciling"
ROLLING_OUT = "RollingOut"
ROLLOUT_COMPLETE = "RolloutComplete"
AS_EXPECTED = "AsExpected"
INVALID_SPEC = "InvalidSpec"
"""A pool's or a tenant's spec the operator cannot act on (a condition and an event)."""
APPLY_FAILED = "ApplyFailed"
"""The API server refused a child of the pool (a condition and an event)."""

# A pool's event reasons (and INVALID_SPEC, APPLY_FAILED)
APPLIED = "Applied"
DRIFT_CORRECTED = "DriftCorrected"
PEER_KEYS_ROTATED = "PeerKeysRotated"
"""A key added to (or dropped from) the pool's peer Secret, between changes of the pool."""


def unavailable(kind: str) -> str:
    """The event reason of a child whose kind the cluster does not serve
    (``ServiceMonitorUnavailable``)."""
    return f"{kind}Unavailable"


# A tenant's condition reasons (and ACCEPTED, INVALID_SPEC); the refusals are events too
POOL_NOT_FOUND = "PoolNotFound"
NAMESPACE_NOT_ALLOWED = "NamespaceNotAllowed"
QUOTA_ABOVE_MAXIMUM = "QuotaAboveMaximum"
SALT_SECRET_MISSING = "SaltSecretMissing"
INVALID_SALT = "InvalidSalt"
TENANT_ID_IN_USE = "TenantIdInUse"
TOKEN_PUBLISHED = "TokenPublished"
NOT_ACCEPTED = "NotAccepted"
POOL_NOT_READY = "PoolNotReady"

# A tenant's event reasons (and ACCEPTED and the refusals)
TOKEN_ROTATED = "TokenRotated"
REVOKED = "Revoked"
CLEAR_INCOMPLETE = "ClearIncomplete"
SPACE_ADMITTED = "SpaceAdmitted"
SPACE_REVOKED = "SpaceRevoked"

# A pool's SharedSpaces condition reasons (and CLEAR_INCOMPLETE); the events on a pool
# about its spaces
SPACES_PUBLISHED = "SpacesPublished"
PINS_NEED_FINGERPRINT = "PinsNeedFingerprint"
PINS_INCOMPLETE = "PinsIncomplete"
SPACE_CREATED = "SpaceCreated"
SPACE_REMOVED = "SpaceRemoved"
