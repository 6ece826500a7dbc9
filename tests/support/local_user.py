"""Another local user of the node (uid 65534, nobody), acting through ``setpriv``.

Only root can become another user, and ``setpriv`` (util-linux) is how: tests that need
it are skipped, with the reason, where either is missing. The other user runs shell
tools only (``sh``, ``cat``, ``truncate``, ``ln``): the test's Python may sit where
nobody can read it.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

NOBODY = 65534

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another user (chown) needs root"
)
needs_another_user = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="acting as another local user (uid 65534) needs root and setpriv (util-linux)",
)


def as_nobody(script: str, *args: str, stdin: bytes = b"") -> None:
    """Run the shell ``script`` (arguments ``$1``...) as uid and gid 65534, no groups."""
    command = [
        "setpriv",
        f"--reuid={NOBODY}",
        f"--regid={NOBODY}",
        "--clear-groups",
        "sh",
        "-c",
        script,
        "sh",
        *args,
    ]
    subprocess.run(command, input=stdin, check=True, capture_output=True, timeout=30)


def plant_file(path: Path, content: bytes, *, size: int | None = None, mode: int = 0o666) -> None:
    """Create ``path`` as the other user, holding ``content`` (sparse up to ``size``)."""
    as_nobody(
        'umask 0 && cat > "$1" && truncate -s "$2" "$1" && chmod "$3" "$1"',
        str(path),
        str(len(content) if size is None else size),
        f"{mode:o}",
        stdin=content,
    )


def plant_symlink(path: Path, target: Path) -> None:
    """A symbolic link at ``path`` to ``target``, made by the other user."""
    as_nobody('ln -s "$2" "$1"', str(path), str(target))


def root_secret(path: Path, content: bytes) -> Path:
    """A file of the test's own user (root), mode 0600: what a planted link points at."""
    path.write_bytes(content)
    path.chmod(0o600)
    return path


def fingerprint(path: Path) -> tuple[int, int, int, bytes] | None:
    """Owner, mode, inode and content of the file at ``path`` (not following a link); None
    if nothing is there."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    content = os.readlink(path).encode() if stat.S_ISLNK(status.st_mode) else path.read_bytes()
    return status.st_uid, stat.S_IMODE(status.st_mode), status.st_ino, content
