"""The shared spaces' salts in a tenant's Secret ``<name>-kvpool``: one key ``space-<name>``
per space that admits the tenant, the space's salt as its value."""

from __future__ import annotations

from collections.abc import Mapping

SALT_KEY_PREFIX = "space-"


def salt_key(space: str) -> str:
    """The key of a tenant's Secret that holds the salt of the space named ``space``."""
    return SALT_KEY_PREFIX + space


def space_of(key: str) -> str | None:
    """The space whose salt a key of a tenant's Secret holds; None for other keys."""
    return key[len(SALT_KEY_PREFIX) :] if key.startswith(SALT_KEY_PREFIX) else None


def handout_changes(current: Mapping[str, str], handed: Mapping[str, str]) -> dict[str, str | None]:
    """What a tenant's Secret (its values ``current``) must change so that its space keys are
    exactly ``handed``: keys to write, and keys to remove (None)."""
    changes: dict[str, str | None] = {
        key: salt for key, salt in handed.items() if current.get(key) != salt
    }
    changes |= {key: None for key in current if space_of(key) and key not in handed}
    return changes
