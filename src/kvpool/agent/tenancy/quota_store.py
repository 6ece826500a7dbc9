"""Durable tenant quotas: where limits set over HTTP are kept across restarts.

The agent loads the stored limits at start and writes every change through
the store before applying it. This module has the interface and the file
backend (the embedded default); a Kubernetes ConfigMap backend shares the
interface. Both keep a tenant's limits in their stored form
(:data:`~kvpool.common.quotas.Quota`): one number (or null) when the tiers agree, the
only form before tiers had limits of their own, so older files still load.

The file is the agent's alone (mode :data:`QUOTA_FILE_MODE`, written through
:mod:`kvpool.common.files`): a quota file that another user owns or may write, or that
is not a regular file, is refused rather than applied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from kvpool.common.files import FileRefused, ensure_directory, open_verified, write_file
from kvpool.common.quotas import Quota, quota_from_json, quota_to_json

QUOTA_FILE_MODE = 0o600


class QuotaStoreError(RuntimeError):
    """The store could not be read or written; the quota change did not happen."""


class QuotaStore(Protocol):
    def load(self) -> dict[str, Quota]: ...

    def save(self, tenant: str, limits: Quota) -> None: ...

    def delete(self, tenant: str) -> None: ...


class FileQuotaStore:
    """Limits in one JSON object ``{tenant: limits}``, replaced atomically on change."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, Quota]:
        try:
            fd, _ = open_verified(self.path, what="quota file", mode=QUOTA_FILE_MODE)
        except FileNotFoundError:
            return {}
        except FileRefused as error:
            raise QuotaStoreError(str(error)) from None
        except OSError as error:
            raise QuotaStoreError(f"cannot read quotas from {self.path}: {error}") from error
        try:
            with os.fdopen(fd, "rb") as handle:
                raw = json.loads(handle.read())
        except (OSError, ValueError) as error:
            raise QuotaStoreError(f"cannot read quotas from {self.path}: {error}") from error
        if not isinstance(raw, dict):
            raise QuotaStoreError(f"{self.path}: expected {{tenant: limits}}")
        limits: dict[str, Quota] = {}
        for tenant, value in raw.items():
            try:
                limits[str(tenant)] = quota_from_json(value)
            except ValueError as error:
                raise QuotaStoreError(f"{self.path}: tenant {tenant}: {error}") from None
        return limits

    def save(self, tenant: str, limits: Quota) -> None:
        stored = self.load()
        stored[tenant] = limits
        self._write(stored)

    def delete(self, tenant: str) -> None:
        limits = self.load()
        if limits.pop(tenant, "absent") != "absent":
            self._write(limits)

    def _write(self, limits: dict[str, Quota]) -> None:
        text = json.dumps(
            {t: quota_to_json(v) for t, v in limits.items()}, indent=1, sort_keys=True
        )
        try:
            ensure_directory(self.path.parent, what="quota file directory")
            write_file(self.path, text.encode(), QUOTA_FILE_MODE, what="quota file")
        except FileRefused as error:
            raise QuotaStoreError(str(error)) from None
        except OSError as error:
            raise QuotaStoreError(f"cannot write quotas to {self.path}: {error}") from error
