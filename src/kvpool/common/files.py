"""Files and directories the agent creates or adopts, out of reach of the node's other users.

The agent's files live where other local users may create names too (``/dev/shm`` is
world-writable; a state or NVMe directory may be), so it never trusts a name, only what
it verified on an open descriptor:

* **Create** with ``O_CREAT|O_EXCL|O_NOFOLLOW`` (a name planted beforehand, a file or a
  symbolic link, fails the call instead of being used), then ``fchmod`` to the exact mode:
  the umask neither widens nor narrows it.
* **Temporaries** get a random name in their target's directory (never a PID, which is
  guessable), and are renamed (or linked) into place.
* **Replace** (rename over) a target only when it is absent or a regular file of the
  agent's own user; anything else at that name is refused.
* **Adopt** an existing file by opening it without following a symbolic link (or following,
  where a mounted Secret's entries need it), then checking the descriptor: a regular file,
  owned by the agent's user (or root, where a caller allows it), granting nothing beyond
  the mode the agent sets.
* **Directories** the agent creates get exactly their mode (0700 unless another user must
  traverse them). One of the agent's own trees must be a real directory of its user (a
  wider mode is narrowed); one that the configuration names (a mount, ``/dev/shm``) must
  belong to the agent's user or root.

Anything refused raises :class:`FileRefused`, an ``OSError`` whose message is one line
naming the path, its owner and its mode.

Two more tools make the agent's files its own for as long as it lives:

* **A lock file** (:class:`LockFile`): an exclusive ``flock`` that the kernel drops when
  its holder ends, however it ends. Only the holder removes the file, and a taker checks,
  once it holds the lock, that the name still names the file it locked; so at most one
  process holds the lock of the file at a name, and none is left behind but by a killed
  holder, for the next taker to adopt.
* **An undo list** (:class:`Undo`): what one start created, removed again if the start
  fails, never what was there before it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Callable, Collection
from pathlib import Path

_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class FileRefused(OSError):
    """A file or directory that is not the agent's to use; the message is one line."""


def describe(status: os.stat_result) -> str:
    """``owner uid N, mode 0NNN`` of a file's status."""
    return f"owner uid {status.st_uid}, mode {stat.S_IMODE(status.st_mode):04o}"


def _kind(status: os.stat_result) -> str:
    mode = status.st_mode
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(what: str, path: Path, problem: str, status: os.stat_result, rule: str) -> FileRefused:
    return FileRefused(f"refusing {what} {path}: {problem} ({describe(status)}); {rule}")


def _own_user() -> str:
    return f"its own user (uid {os.geteuid()})"


def create_exclusive(path: Path, mode: int, flags: int = os.O_RDWR) -> int:
    """A new file at ``path`` with exactly ``mode``; ``FileExistsError`` if anything is there."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, mode)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def temporary_name(target: Path) -> Path:
    """A random, unguessable name beside ``target`` for the file that will replace it."""
    return target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")


def create_temporary(target: Path, mode: int, flags: int = os.O_RDWR) -> tuple[int, Path]:
    """A new file with exactly ``mode`` beside ``target``, under :func:`temporary_name`."""
    temporary = temporary_name(target)
    return create_exclusive(temporary, mode, flags), temporary


def check_replaceable(path: Path, what: str) -> None:
    """Before renaming over ``path``: it must be absent or a regular file of the agent's user.

    What is there is never opened: a rename replaces the name, not the file behind it.
    """
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(status.st_mode) and status.st_uid == os.geteuid():
        return
    problem = (
        f"it is {_kind(status)}"
        if not stat.S_ISREG(status.st_mode)
        else "it belongs to another user"
    )
    rule = f"the agent replaces only a regular file of {_own_user()}: remove it"
    raise _refuse(what, path, problem, status, rule)


def check_socket_replaceable(path: Path, what: str) -> bool:
    """Before binding a Unix socket at ``path``: whether a socket of the agent's user is there
    (an earlier process's, for the caller to remove once it knows nobody serves it).

    Absent is fine (False); anything else there is refused, and never opened.
    """
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISSOCK(status.st_mode) and status.st_uid == os.geteuid():
        return True
    problem = (
        f"it is {_kind(status)}"
        if not stat.S_ISSOCK(status.st_mode)
        else "it belongs to another user"
    )
    rule = f"the agent replaces only a socket of {_own_user()}: remove it"
    raise _refuse(what, path, problem, status, rule)


def write_file(path: Path, data: bytes, mode: int, *, what: str, replace: bool = True) -> bool:
    """Write ``data`` to a new file with exactly ``mode`` and put it at ``path`` whole.

    With ``replace``, an earlier file there (see :func:`check_replaceable`) is replaced
    atomically; without, ``path`` is linked only if it is still absent (False if not).
    """
    if replace:
        check_replaceable(path, what)
    fd, temporary = create_temporary(path, mode, os.O_WRONLY)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(temporary, path)
            return True
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False
        return True
    finally:
        temporary.unlink(missing_ok=True)


def open_verified(
    path: Path,
    *,
    what: str,
    mode: int,
    flags: int = os.O_RDONLY,
    follow_symlinks: bool = False,
    owners: Collection[int] | None = None,
    rule: str | None = None,
) -> tuple[int, os.stat_result]:
    """Open an existing file and check it on the descriptor; the descriptor and its status.

    ``FileNotFoundError`` if it is absent; :class:`FileRefused` unless it is a regular file
    owned by one of ``owners`` (default: the agent's user) whose mode grants nothing beyond
    ``mode``. Nothing is read or written before the check (a FIFO does not block the open).
    """
    allowed = {os.geteuid()} if owners is None else set(owners)
    if rule is None:
        whose = _own_user() if owners is None else "uid " + " or ".join(map(str, sorted(allowed)))
        rule = (
            f"the agent adopts only a regular file of {whose} with mode {mode:04o} or narrower: "
            "remove it, or fix its owner and mode"
        )
    extra = os.O_NONBLOCK | (os.O_CLOEXEC if follow_symlinks else _NO_FOLLOW)
    try:
        fd = os.open(path, flags | extra)
    except FileNotFoundError:
        raise
    except OSError as error:
        try:
            status = os.stat(path) if follow_symlinks else os.lstat(path)
        except OSError:
            raise error from None
        if stat.S_ISREG(status.st_mode):
            raise
        raise _refuse(what, path, f"it is {_kind(status)}", status, rule) from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise _refuse(what, path, f"it is {_kind(status)}", status, rule)
        if status.st_uid not in allowed:
            raise _refuse(what, path, "it belongs to another user", status, rule)
        if stat.S_IMODE(status.st_mode) & ~mode:
            raise _refuse(what, path, f"its mode grants more than {mode:04o}", status, rule)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, status


def ensure_directory(
    path: Path, *, what: str, mode: int = 0o700, own: bool = False, guard_entries: bool = False
) -> bool:
    """Create ``path`` (and any missing parent) with exactly ``mode``, or check the one there.

    ``own``: a directory of the agent's own tree, which must be a real directory (not a
    link) of the agent's user; a mode other than ``mode`` is set to ``mode``. Otherwise a
    directory the configuration names (a mount, ``/dev/shm``; links followed), which must
    belong to the agent's user or root; with ``guard_entries``, other users must not be able
    to rename its entries (not writable by them, or sticky, as /dev/shm is).
    Returns whether it changed an existing directory's mode. :class:`FileRefused` if refused.
    """
    try:
        _make_directories(path, mode)
        return False
    except FileExistsError:
        pass
    flags = os.O_RDONLY | os.O_DIRECTORY | (_NO_FOLLOW if own else os.O_CLOEXEC)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        status = os.lstat(path)
        raise _refuse(
            what, path, f"it is {_kind(status)}, not a directory", status, _directory_rule(own)
        ) from None
    try:
        status = os.fstat(fd)
        if own:
            if status.st_uid != os.geteuid():
                raise _refuse(
                    what, path, "it belongs to another user", status, _directory_rule(own)
                )
            if stat.S_IMODE(status.st_mode) != mode:
                os.fchmod(fd, mode)
                return True
            return False
        if status.st_uid not in (os.geteuid(), 0):
            raise _refuse(what, path, "it belongs to another user", status, _directory_rule(own))
        others_rename = status.st_mode & stat.S_IWOTH and not status.st_mode & stat.S_ISVTX
        if guard_entries and others_rename:
            raise _refuse(
                what,
                path,
                "any user may rename its entries",
                status,
                "make it not writable by others, or sticky (chmod +t), as /dev/shm is",
            )
        return False
    finally:
        os.close(fd)


def _directory_rule(own: bool) -> str:
    if own:
        return f"the agent keeps its files only in directories of {_own_user()}: remove it"
    return f"the agent keeps its files only in a directory of {_own_user()} or root"


def _make_directories(path: Path, mode: int) -> None:
    """``mkdir -p`` giving every directory it creates exactly ``mode``; FileExistsError if
    ``path`` exists (whatever it is)."""
    try:
        os.mkdir(path, mode)
    except FileNotFoundError:
        if path.parent == path:
            raise
        with contextlib.suppress(FileExistsError):
            _make_directories(path.parent, mode)
        os.mkdir(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


class LockFile:
    """An exclusive ``flock`` held on the file at :attr:`path` (see the module docstring)."""

    ATTEMPTS = 100
    """Tries of :meth:`take` when the file keeps being replaced under it (a busy name)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, path: Path, *, what: str, mode: int, note: str) -> LockFile | None:
        """Hold the lock of the file at ``path``, created (exactly ``mode``) if absent; None
        while another process holds it. ``note`` (who holds it) is written into the file once
        it is held, for a refused taker to name (:meth:`holder`). :class:`FileRefused` if
        what is at ``path`` is not the agent's (see :func:`open_verified`).
        """
        for _ in range(cls.ATTEMPTS):
            try:
                fd = create_exclusive(path, mode)
            except FileExistsError:
                try:
                    fd, _ = open_verified(path, what=what, mode=mode, flags=os.O_RDWR)
                except FileNotFoundError:
                    continue  # its holder removed it meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except BaseException:
                os.close(fd)
                raise
            if not _names(path, fd):
                os.close(fd)  # removed by the holder this taker waited for: the name is free
                continue
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, note.encode(), 0)
            except BaseException:
                cls(path, fd).release()
                raise
            return cls(path, fd)
        return None

    @classmethod
    def claim(cls, path: Path, *, what: str, mode: int) -> LockFile | str:
        """:meth:`take` noting this process as the holder: the lock, or who holds it now."""
        note = f"pid {os.getpid()} on {os.uname().nodename}"
        held = cls.take(path, what=what, mode=mode, note=note)
        if held is not None:
            return held
        holder = cls.holder(path)
        return f"agent {holder}" if holder else f"the process that holds {path}"

    @staticmethod
    def holder(path: Path) -> str:
        """The note of whoever holds (or last held) the lock at ``path``; "" if none is there."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NO_FOLLOW)
        except OSError:
            return ""
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ""
            text = os.pread(fd, 512, 0).decode(errors="replace")
        except OSError:
            return ""
        finally:
            os.close(fd)
        return " ".join(text.split())

    def release(self) -> None:
        """Remove the file (still the holder's: only a holder removes it) and drop the lock."""
        if self._fd is None:
            return
        try:
            if _names(self.path, self._fd):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` names the file open at ``fd``."""
    try:
        there = os.lstat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino)


class Undo:
    """What one start created, to remove again if it fails; never what was there before it.

    Files are recorded once they are created (:meth:`file`), directories before
    (:meth:`directories` notes which of them, and of their parents, are missing then). A
    file that replaces another is made under a temporary name (:meth:`pending`) and takes
    its place only once the start succeeded, so a failed start leaves the earlier one as it
    was. :meth:`run` removes the files, then those directories that are still empty, deepest
    first; :meth:`keep` puts the pending files in place and forgets everything once the
    start succeeded.
    """

    def __init__(self) -> None:
        self._files: list[Path] = []
        self._directories: list[Path] = []
        self._installs: list[Callable[[], None]] = []

    def file(self, path: Path) -> None:
        self._files.append(path)

    def pending(self, temporary: Path, install: Callable[[], None]) -> None:
        """A file made under a ``temporary`` name; ``install`` (by :meth:`keep`) renames it
        into place, :meth:`run` removes it."""
        self._files.append(temporary)
        self._installs.append(install)

    def directories(self, *paths: Path) -> None:
        """Note which of ``paths`` (and of their parents) do not exist yet."""
        for path in paths:
            missing: list[Path] = []
            here = path
            while not os.path.lexists(here) and here.parent != here:
                missing.append(here)
                here = here.parent
            self._directories.extend(reversed(missing))

    def keep(self) -> None:
        """The start succeeded: the pending files take their names, and every file stays."""
        for install in self._installs:
            install()
        self._forget()

    def run(self, before_directories: Callable[[], None] | None = None) -> None:
        """Remove the files; call ``before_directories`` (the owner locks let go: a lock file
        keeps its directory); remove the directories still empty."""
        for path in reversed(self._files):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        if before_directories is not None:
            before_directories()
        for path in sorted(set(self._directories), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # not empty (or not there): it stays
                path.rmdir()
        self._forget()

    def _forget(self) -> None:
        self._files.clear()
        self._directories.clear()
        self._installs.clear()
