"""The pool's L2 master keys, read from a directory (a mounted Secret, or a generated file).

Each file whose name is a positive integer is a key: the name is its id, its
content (stripped of surrounding whitespace, at least :data:`MIN_KEY_BYTES`) the
key material. The highest id seals new objects; every id present opens old ones,
so a key is rotated by adding a higher id and, once objects under the old one
have aged out, removing it. Other entries (a Secret mount's ``..data`` links)
are ignored.

The directory is reread at most every :data:`RELOAD_SECONDS`, by whichever
thread asks first, so that a Secret the kubelet updates in place takes effect
with no restart. A reread that fails keeps the keys in use and logs why. Key
material never reaches a log.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 32
RELOAD_SECONDS = 30.0
GENERATED_KEY_ID = 1


class KeyringError(ValueError):
    """The key directory holds no usable key (or an unusable one)."""


@dataclass(frozen=True, slots=True)
class Keys:
    """One reading of the key directory."""

    by_id: dict[int, bytes]

    @property
    def active_id(self) -> int:
        return max(self.by_id)


def read_keys(directory: Path) -> Keys:
    """The keys in ``directory``; :class:`KeyringError` if there are none or one is too short."""
    found: dict[int, bytes] = {}
    try:
        entries = list(os.scandir(directory))
    except OSError as error:
        raise KeyringError(f"cannot list the L2 key directory {directory}: {error}") from error
    for entry in entries:
        if not entry.name.isdecimal() or int(entry.name) < 1 or entry.is_dir():
            continue
        material = Path(entry.path).read_bytes().strip()
        if len(material) < MIN_KEY_BYTES:
            raise KeyringError(
                f"L2 key {entry.name} in {directory} has {len(material)} bytes; "
                f"a key needs at least {MIN_KEY_BYTES} (e.g. `openssl rand -hex 32`)"
            )
        found[int(entry.name)] = material
    if not found:
        raise KeyringError(
            f"the L2 key directory {directory} holds no key (a file named by a positive "
            "integer key id)"
        )
    return Keys(found)


def generate_key(directory: Path) -> None:
    """Create key :data:`GENERATED_KEY_ID` (mode 0600) unless the directory holds a key."""
    try:
        read_keys(directory)
        return
    except KeyringError:
        pass
    path = directory / str(GENERATED_KEY_ID)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:  # another agent on this node made it first
        return
    except OSError as error:
        raise KeyringError(
            f"the L2 key directory {directory} holds no key, and one cannot be made there: "
            f"{error.strerror}"
        ) from error
    try:
        os.write(fd, secrets.token_hex(32).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    log.info("generated L2 key %d in %s", GENERATED_KEY_ID, directory)


class Keyring:
    """The current :class:`Keys` of a directory, reread every :data:`RELOAD_SECONDS`."""

    def __init__(self, directory: Path, reload_seconds: float = RELOAD_SECONDS) -> None:
        """Read ``directory`` now; :class:`KeyringError` if it holds no usable key."""
        self.directory = directory
        self._reload_seconds = reload_seconds
        self._keys = read_keys(directory)
        self._read_at = time.monotonic()
        self._reloading = threading.Lock()
        log.info("L2 keys %s from %s", sorted(self._keys.by_id), directory)

    def current(self) -> Keys:
        if time.monotonic() - self._read_at >= self._reload_seconds and self._reloading.acquire(
            blocking=False
        ):
            try:
                self._reload()
            finally:
                self._reloading.release()
        return self._keys

    def _reload(self) -> None:
        self._read_at = time.monotonic()
        try:
            keys = read_keys(self.directory)
        except (KeyringError, OSError) as error:
            log.warning("L2 keys: keeping keys %s: %s", sorted(self._keys.by_id), error)
            return
        if keys != self._keys:
            log.info("L2 keys now %s (sealing with %d)", sorted(keys.by_id), keys.active_id)
            self._keys = keys
