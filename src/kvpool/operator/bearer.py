"""Bearer tokens the operator mints: the tenants' (into their Secrets) and its own.

Agents learn only a token's digest (:func:`kvpool.common.tenants_configmap.digest_token`),
through the pool's tenants ConfigMap. The operator's own admin token is generated at its
start and kept in memory only: it reads the tenants' usage and clears a deleted tenant's
chunks with it, and a restarted operator publishes a new one (the old one stops working).
"""

from __future__ import annotations

import secrets

from kvpool.common.tenants_configmap import digest_token


def mint() -> str:
    """A new bearer token: 32 random bytes, URL-safe base64."""
    return secrets.token_urlsafe(32)


class OperatorToken:
    """The operator's admin token; its repr shows no secret (it may end up in a log)."""

    def __init__(self) -> None:
        self.value = mint()
        self.digest = digest_token(self.value)

    def __repr__(self) -> str:
        return f"OperatorToken(digest={self.digest.hex()[:8]}...)"
