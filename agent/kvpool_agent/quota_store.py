"""Durable tenant quotas: where limits set over HTTP are kept across restarts.

The agent loads the stored limits at start and writes every change through
the store before applying it. This module has the interface and the file
backend (the embedded default); a Kubernetes ConfigMap backend shares the
interface.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Protocol

from kvpool_agent.quotas import Limit


class QuotaStoreError(RuntimeError):
    """The store could not be read or written; the quota change did not happen."""


class QuotaStore(Protocol):
    def load(self) -> dict[str, Limit]: ...

    def save(self, tenant: str, limit: Limit) -> None: ...

    def delete(self, tenant: str) -> None: ...


class FileQuotaStore:
    """Limits in one JSON object ``{tenant: bytes or null}``, replaced atomically on change."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, Limit]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            raise QuotaStoreError(f"cannot read quotas from {self.path}: {error}") from error
        if not isinstance(raw, dict) or not all(
            value is None or (isinstance(value, int) and value >= 0) for value in raw.values()
        ):
            raise QuotaStoreError(f"{self.path}: expected {{tenant: bytes >= 0 or null}}")
        return {str(tenant): limit for tenant, limit in raw.items()}

    def save(self, tenant: str, limit: Limit) -> None:
        limits = self.load()
        limits[tenant] = limit
        self._write(limits)

    def delete(self, tenant: str) -> None:
        limits = self.load()
        if limits.pop(tenant, "absent") != "absent":
            self._write(limits)

    def _write(self, limits: dict[str, Limit]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        except OSError as error:
            raise QuotaStoreError(f"cannot write quotas to {self.path}: {error}") from error
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(limits, handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
        except OSError as error:
            Path(temporary).unlink(missing_ok=True)
            raise QuotaStoreError(f"cannot write quotas to {self.path}: {error}") from error
