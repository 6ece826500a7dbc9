"""The agents' tokens for the index's lookups, derived from the pool's peer credential.

An agent that misses a prefix asks the index which of its peers hold it, with a token
it derives from the pool's peer credential
(:func:`~kvpool.common.handshake.lookup_token`). The index mounts the same
credential and accepts the token of every key id it holds as a gateway's (lookups and
routes, nothing else), re-derived as the credential rotates: no other Secret to hand out.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvpool.common.auth import GATEWAY, TokenAuthority
from kvpool.common.handshake import lookup_token
from kvpool.common.keyring import RELOAD_SECONDS, Keyring
from kvpool.common.tenants_configmap import digest_token


class PeerLookups:
    def __init__(self, authority: TokenAuthority, key_dir: Path, pool: str) -> None:
        """:class:`~kvpool.common.keyring.KeyringError` if ``key_dir`` holds no usable key."""
        self._authority = authority
        self._keyring = Keyring(key_dir, what="peer key")
        self._pool = pool

    def grant(self) -> None:
        """Accept the token of every peer key held now (and no other agents' token)."""
        keys = self._keyring.current()
        tokens = [lookup_token(keys, key_id, self._pool) for key_id in keys.by_id]
        self._authority.replace_granted([(digest_token(token), GATEWAY) for token in tokens])

    async def follow(self) -> None:
        """:meth:`grant` now and whenever the credential may have rotated, until cancelled."""
        while True:
            self.grant()
            await asyncio.sleep(RELOAD_SECONDS)
