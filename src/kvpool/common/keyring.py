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

A key file must be a regular file (a Secret's entries are links into its current
version, so links are followed) owned by the agent's user or root (the kubelet writes
a Secret's files as root) that no group or other user may write: anyone who could
write it could choose the key. One readable by every user is used, with a warning (a
Secret mounted with ``defaultMode`` 0440 is readable by the pod's group only). A key the
agent generates goes into a directory it creates 0700, in a file it creates 0600.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvpool.common.files import FileRefused, ensure_directory, open_verified, write_file

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 32
RELOAD_SECONDS = 30.0
GENERATED_KEY_ID = 1
KEY_FILE_MODE = 0o600
"""A generated key: the agent's user only."""
_KEY_FILE_LIMIT = 0o755
"""What a key file may grant at most: never write to the group or other users."""
_KEY_FILE_RULE = (
    "a key file must be a regular file of the agent's user or root that neither its "
    "group nor other users may write (chmod go-w)"
)


class KeyringError(ValueError):
    """The key directory holds no usable key (or an unusable one)."""


@dataclass(frozen=True, slots=True)
class Keys:
    """One reading of the key directory."""

    by_id: dict[int, bytes]

    @property
    def active_id(self) -> int:
        return max(self.by_id)


def read_keys(
    directory: Path, warn: Callable[[str], None] | None = log.warning, what: str = "L2 key"
) -> Keys:
    """The keys in ``directory``; :class:`KeyringError` if there are none or one is unusable.

    ``warn`` hears of each key file readable by every user (None: nobody does); ``what``
    names the keys in messages (the L2 keys, or the peers').
    """
    found: dict[int, bytes] = {}
    try:
        entries = list(os.scandir(directory))
    except OSError as error:
        raise KeyringError(f"cannot list the {what} directory {directory}: {error}") from error
    for entry in entries:
        if not entry.name.isdecimal() or int(entry.name) < 1 or entry.is_dir():
            continue
        path = Path(entry.path)
        try:
            fd, status = open_verified(
                path,
                what=f"{what} file",
                mode=_KEY_FILE_LIMIT,
                follow_symlinks=True,
                owners={os.geteuid(), 0},
                rule=_KEY_FILE_RULE,
            )
        except FileRefused as error:
            raise KeyringError(str(error)) from None
        except OSError as error:
            raise KeyringError(f"cannot read {what} {path}: {error.strerror}") from error
        with os.fdopen(fd, "rb") as handle:
            material = handle.read().strip()
        if status.st_mode & stat.S_IROTH and warn is not None:
            warn(
                f"{what} file {path} is readable by every user (owner uid {status.st_uid}, "
                f"mode {stat.S_IMODE(status.st_mode):04o}): chmod o-r, or mount the Secret "
                "with defaultMode 0440"
            )
        if len(material) < MIN_KEY_BYTES:
            raise KeyringError(
                f"{what} {entry.name} in {directory} has {len(material)} bytes; "
                f"a key needs at least {MIN_KEY_BYTES} (e.g. `openssl rand -hex 32`)"
            )
        found[int(entry.name)] = material
    if not found:
        raise KeyringError(
            f"the {what} directory {directory} holds no key (a file named by a positive "
            "integer key id)"
        )
    return Keys(found)


def generate_key(directory: Path) -> Path | None:
    """Create key :data:`GENERATED_KEY_ID` (mode 0600) unless the directory holds a key; the
    file made (None: there was a key, or another agent made it first)."""
    try:
        read_keys(directory, warn=None)
        return None
    except KeyringError:
        pass
    path = directory / str(GENERATED_KEY_ID)
    try:
        ensure_directory(directory, what="L2 key directory")
        made = write_file(
            path, secrets.token_hex(32).encode(), KEY_FILE_MODE, what="L2 key", replace=False
        )
    except FileRefused as error:
        raise KeyringError(str(error)) from None
    except OSError as error:
        raise KeyringError(
            f"the L2 key directory {directory} holds no key, and one cannot be made there: "
            f"{error.strerror}"
        ) from error
    if not made:  # another agent on this node made it first
        return None
    log.info("generated L2 key %d in %s", GENERATED_KEY_ID, directory)
    return path


class Keyring:
    """The current :class:`Keys` of a directory, reread every :data:`RELOAD_SECONDS`."""

    def __init__(
        self, directory: Path, reload_seconds: float = RELOAD_SECONDS, what: str = "L2 key"
    ) -> None:
        """Read ``directory`` now; :class:`KeyringError` if it holds no usable key. ``what``
        names the keys in messages."""
        self.directory = directory
        self.what = what
        self._reload_seconds = reload_seconds
        self._warned: set[str] = set()
        self._keys = read_keys(directory, self._warn, what)
        self._read_at = time.monotonic()
        self._reloading = threading.Lock()
        log.info("%ss %s from %s", what, sorted(self._keys.by_id), directory)

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
            keys = read_keys(self.directory, self._warn, self.what)
        except (KeyringError, OSError) as error:
            log.warning("%ss: keeping keys %s: %s", self.what, sorted(self._keys.by_id), error)
            return
        if keys != self._keys:
            log.info("%ss now %s (active: %d)", self.what, sorted(keys.by_id), keys.active_id)
            self._keys = keys

    def _warn(self, message: str) -> None:
        """Once per key file and mode: the directory is reread every few seconds."""
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s", message)
