"""Which keys a pool's peer Secret holds, and when each was made (pure).

The Secret is an agent key directory (``kvpool.common.keyring``'s format): each key's
name is its id (``"1"``, ``"2"``, ...), its value 32 random bytes as 64 hex characters. The
highest id is the one the agents prove and seal with; every id present is accepted. The
annotation :data:`CREATED_ANNOTATION` records when the operator made each key (a JSON
object, id to an RFC 3339 time).

A pass at ``now``: a Secret without a usable key gets key 1; once the newest key is a
rotation period old, the next id is added; the two newest keys stay (the previous one for
the agents that have not reread the Secret yet), older ones go: by then each is two
rotations old or more. A value that is not a key (another length, not hex) or a name that
is not an id leaves the Secret, and a key whose time is not recorded counts as made now.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from kvpool.operator.spec import GROUP

KEY_BYTES = 32
KEPT = 2
"""The newest key and the one before it."""
CREATED_ANNOTATION = f"{GROUP}/peer-keys-created"
_KEY = re.compile(f"[0-9a-f]{{{2 * KEY_BYTES}}}")


def mint_key() -> str:
    """A new key: :data:`KEY_BYTES` random bytes, hex."""
    return secrets.token_hex(KEY_BYTES)


@dataclass(frozen=True)
class PeerKeyring:
    """The keys of a peer Secret by id, and when each was made."""

    keys: Mapping[int, str]
    created: Mapping[int, datetime]

    @classmethod
    def read(cls, values: Mapping[str, str], annotation: str | None, now: datetime) -> PeerKeyring:
        """The keys among a Secret's ``values`` and their times from its ``annotation``."""
        keys = {
            int(name): value
            for name, value in values.items()
            if name.isdecimal() and int(name) > 0 and _KEY.fullmatch(value)
        }
        recorded = _times(annotation)
        return cls(keys, {key: recorded.get(key, now) for key in keys})

    def rotated(self, now: datetime, every: timedelta) -> PeerKeyring:
        """The keys after a pass at ``now`` with a rotation period of ``every``."""
        keys, created = dict(self.keys), dict(self.created)
        if not keys or now - created[max(keys)] >= every:
            added = max(keys, default=0) + 1
            keys[added], created[added] = mint_key(), now
        kept = sorted(keys)[-KEPT:]
        return PeerKeyring({key: keys[key] for key in kept}, {key: created[key] for key in kept})

    def values(self) -> dict[str, str]:
        """The Secret's values: each key under its id."""
        return {str(key): value for key, value in sorted(self.keys.items())}

    def annotation(self) -> str:
        """:data:`CREATED_ANNOTATION`'s value."""
        return json.dumps(
            {str(key): time.isoformat() for key, time in sorted(self.created.items())},
            separators=(",", ":"),
        )


def _times(annotation: str | None) -> dict[int, datetime]:
    """The recorded times of an annotation (those with a time zone); nothing of one that
    does not parse."""
    try:
        loaded = json.loads(annotation or "{}")
        times = {int(key): datetime.fromisoformat(value) for key, value in loaded.items()}
    except (ValueError, TypeError, AttributeError):
        return {}
    return {key: time for key, time in times.items() if time.tzinfo is not None}
