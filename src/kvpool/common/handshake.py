"""Peers prove to each other that they hold the pool's peer credential.

The credential is a key directory (:class:`~kvpool.common.keyring.Keyring`,
a Secret the operator makes per pool and rotates by adding a higher key id).
Neither side ever sends a key: each sends an HMAC-SHA256, under a key derived
from one key id both hold, over both nonces, both node names and the pool, with
its role first so that a proof cannot be reflected back. The server lists the
ids it holds in its hello; the client proves with the highest id it holds too,
so that peers that read a rotated Secret at different times still agree.
Both nonces are fresh per connection: a recorded exchange proves nothing later.

The same credential gives each agent a token for the pool's prefix index
(:func:`lookup_token`): the index, which mounts the credential too, accepts it for its
lookups, so an agent asks the index which peers hold a prefix.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from collections.abc import Iterable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvpool.common.keyring import Keys

NONCE_BYTES = 32
"""The size of each side's nonce (the peer wire checks it)."""

CLIENT = b"client"
SERVER = b"server"


class NotProven(ValueError):
    """The other side does not hold the pool's peer credential (or shares no key id)."""


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def common_key(keys: Keys, offered: Iterable[int]) -> int:
    """The highest key id in both ``keys`` and ``offered``; :class:`NotProven` if none."""
    shared = set(keys.by_id) & set(offered)
    if not shared:
        raise NotProven(
            f"no peer key in common (this agent holds {sorted(keys.by_id)}, "
            f"the peer {sorted(offered)})"
        )
    return max(shared)


def proof(
    keys: Keys,
    key_id: int,
    *,
    pool: str,
    role: bytes,
    nonces: tuple[bytes, bytes],
    nodes: tuple[str, str],
) -> bytes:
    """``role``'s proof: nonces and nodes are (server's, client's) on both sides."""
    material = keys.by_id.get(key_id)
    if material is None:
        raise NotProven(f"the peer proves with key {key_id}, which this agent does not hold")
    fields = [role, pool.encode(), *nonces, *(node.encode() for node in nodes)]
    message = b"".join(len(field).to_bytes(4, "little") + field for field in fields)
    return hmac.new(_auth_key(material, pool.encode()), message, hashlib.sha256).digest()


def lookup_token(keys: Keys, key_id: int, pool: str) -> str:
    """The bearer token with which an agent asks its pool's prefix index which peers hold a
    prefix: derived from peer key ``key_id``, so the index (which mounts the same Secret)
    knows it without another credential, and it changes with every rotation."""
    message = b"kvpool-peer index lookup\0" + pool.encode()
    mac = hmac.new(_auth_key(keys.by_id[key_id], pool.encode()), message, hashlib.sha256)
    return mac.hexdigest()


def check(expected: bytes, received: bytes) -> None:
    if not hmac.compare_digest(expected, received):
        raise NotProven("the peer's proof is wrong: it does not hold the pool's peer key")


@functools.lru_cache(maxsize=64)
def _auth_key(material: bytes, pool: bytes) -> bytes:
    """Apart from the keys that seal chunks (the codec derives those per tenant)."""
    info = b"kvpool-peer auth " + pool
    return HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(material)
