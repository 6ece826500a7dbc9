"""Bind mounts through mount(2) and umount2(2), and this process's mount table.

The system calls go through ctypes rather than util-linux's ``mount``: no binary to ship in
the image, no output to parse, and a failure is an errno. A published directory is bound,
then remounted ``nosuid,nodev,noexec`` (and ``ro`` when asked): a bind mount takes the
flags of its source until it is remounted.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
PUBLISHED_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
PUBLISHED_OPTIONS = frozenset({"nosuid", "nodev", "noexec"})
"""The mount options of a published directory (as /proc/self/mountinfo names them)."""

MOUNTINFO = Path("/proc/self/mountinfo")
_ESCAPE = re.compile(r"\\([0-7]{3})")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


@dataclass(frozen=True, slots=True)
class Mount:
    """One line of /proc/self/mountinfo."""

    mount_point: str
    root: str
    """The directory of the source filesystem mounted here (a bind mount's source)."""
    options: frozenset[str]
    fstype: str
    source: str


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order (a later mount covers an earlier one)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        mounts.append(
            Mount(
                mount_point=_unescape(fields[4]),
                root=_unescape(fields[3]),
                options=frozenset(fields[5].split(",")),
                fstype=fields[separator + 1],
                source=_unescape(fields[separator + 2]),
            )
        )
    return mounts


def _unescape(text: str) -> str:
    return _ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), text)


def mounted_at(path: Path, mountinfo: Path = MOUNTINFO) -> Mount | None:
    """The mount on top at ``path`` (a resolved path), or None."""
    found = None
    for mount in parse_mountinfo(mountinfo.read_text()):
        if mount.mount_point == str(path):
            found = mount
    return found


def bind(source: Path, target: Path, *, readonly: bool) -> None:
    """Bind the directory ``source`` onto ``target``, then remount it nosuid, nodev, noexec
    (and ro); OSError if either fails (nothing stays mounted). ``source`` is opened without
    following a symlink and bound through that descriptor: a directory swapped for a
    symlink after the caller checked it is never bound."""
    handle = os.open(source, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _mount(Path(f"/proc/self/fd/{handle}"), target, MS_BIND)
    finally:
        os.close(handle)
    try:
        restrict(target, readonly=readonly)
    except OSError:
        try:
            unmount(target)
        except OSError:
            unmount(target, lazy=True)  # never leave it mounted without its flags
        raise


def restrict(target: Path, *, readonly: bool) -> None:
    """Remount the bind mount at ``target`` with the published flags."""
    flags = MS_REMOUNT | MS_BIND | PUBLISHED_FLAGS | (MS_RDONLY if readonly else 0)
    _mount(None, target, flags)


MNT_DETACH = 2


def unmount(target: Path, *, lazy: bool = False) -> None:
    if _libc.umount2(os.fsencode(target), MNT_DETACH if lazy else 0) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number), str(target))


def _mount(source: Path | None, target: Path, flags: int) -> None:
    source_bytes = None if source is None else os.fsencode(source)
    if _libc.mount(source_bytes, os.fsencode(target), None, flags, None) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number), str(target))
