"""The ``data`` of a Secret: each value base64, read and written as text."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any


def decoded(secret: Mapping[str, Any] | None) -> dict[str, str]:
    """A Secret's values as text (none for an absent Secret)."""
    data = (secret or {}).get("data") or {}
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def encoded(values: Mapping[str, str | None]) -> dict[str, str | None]:
    """Values for a Secret's ``data`` (None stays None: a merge patch removes that key)."""
    return {
        key: None if value is None else base64.b64encode(value.encode()).decode()
        for key, value in values.items()
    }
