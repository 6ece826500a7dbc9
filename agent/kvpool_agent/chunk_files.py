"""Chunk files: one sparse file per L1 account (a tenant, a shared space, the canary).

The segment's allocator hands out pages of one address space for every account; a chunk's
bytes live in its account's file, at the chunk's segment offset. Each file is as long as
the segment and holds memory only where its account's chunks are: the agent gives the
pages to a file when it places a chunk (:meth:`ChunkFiles.take`, a ``fallocate``, so a
full shared-memory filesystem is a refused store and never a ``SIGBUS`` in a writer) and
takes them back when the chunk goes (:meth:`ChunkFiles.give_back`, a hole punched). Pages
stay charged once, to the file of the chunk that uses them.

No client opens these files by path. The directory (:func:`files_directory`, beside the
segment) is the agent's alone (mode 0700); a connector gets a descriptor of a file from
the agent's door (:mod:`kvpool_agent.door`), read-write or read-only as its token may, and
maps it. So a tenant's pod maps its own tenant's chunks and, read-only, its shared spaces':
never another tenant's, whose file it cannot name, open or find.

A file is known to clients by its inode number (:meth:`ChunkFiles.file_id`), which the
agent's replies name beside each offset: a client that holds a descriptor of an earlier
file (an agent that started from empty made new ones) sees the number differ. The file of
an account is named after the account (hex of its id), so a restarted agent that adopts
its segment adopts the files with it (:meth:`ChunkFiles.open`).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvpool_agent.files import FileRefused, create_exclusive, ensure_directory, open_verified

FILE_MODE = 0o600
"""The agent's user only: clients get descriptors from the door, never the path."""
DIRECTORY_MODE = 0o700
SUFFIX = ".kv"


class ChunkFilesFull(OSError):
    """The shared-memory filesystem has no room for a chunk's pages."""


def files_directory(segment_path: Path) -> Path:
    """The chunk files of the segments at ``segment_path``: ``<segment>.files``, beside it,
    one directory in it per segment (:func:`generation_directory`)."""
    return segment_path.with_name(segment_path.name + ".files")


def generation_directory(segment_path: Path, segment_inode: int) -> Path:
    """The chunk files of one segment: named after its file's inode, which a segment made
    under a temporary name keeps once it takes its name. A start that makes a new segment
    and then fails leaves the earlier segment's files as they were."""
    return files_directory(segment_path) / str(segment_inode)


def remove_other_generations(directory: Path) -> None:
    """Remove the chunk files of every segment but the one of ``directory`` (segments that
    are no longer at their path)."""
    for entry in directory.parent.iterdir():
        if entry != directory and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)


def file_name(owner: str) -> str:
    """The file of an account: its id in hex (ids are at most 32 bytes: see journal.py)."""
    return owner.encode().hex() + SUFFIX


def owner_of(name: str) -> str | None:
    """The account whose file is named ``name``; None for a name no account's file has."""
    if not name.endswith(SUFFIX):
        return None
    try:
        return bytes.fromhex(name.removesuffix(SUFFIX)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass
class _File:
    owner: str
    path: Path
    fd: int
    file_id: int
    mapping: mmap.mmap
    view: memoryview


class ChunkFiles:
    """The chunk files of one segment of ``size`` bytes, created as accounts need them."""

    def __init__(self, directory: Path, size: int) -> None:
        self.directory = directory
        self.size = size
        self._by_owner: dict[str, _File] = {}
        self._by_id: dict[int, _File] = {}
        self._given: dict[str, int] = {}
        """Bytes given to each file for its chunks (:meth:`take` less :meth:`give_back`)."""
        self._making = threading.Lock()

    @classmethod
    def open(cls, directory: Path, size: int, *, adopt: bool) -> ChunkFiles:
        """The files of a segment (in its :func:`generation_directory`), adopted (``adopt``:
        keep the files there, the chunks of a warm restart) or new (remove whatever is
        there)."""
        if not adopt and directory.is_dir() and not directory.is_symlink():
            shutil.rmtree(directory)
        for level in (directory.parent, directory):
            ensure_directory(level, what="chunk files directory", mode=DIRECTORY_MODE, own=True)
        files = cls(directory, size)
        if adopt:
            for entry in sorted(os.listdir(directory)):
                owner = owner_of(entry)
                if owner is None:
                    continue
                files._adopt(owner)
        return files

    # ------------------------------------------------------------------ lookups

    def owners(self) -> list[str]:
        return list(self._by_owner)

    def file_id(self, owner: str) -> int:
        """The id (inode number) of ``owner``'s file; 0 if it has none (it never stored)."""
        found = self._by_owner.get(owner)
        return 0 if found is None else found.file_id

    def view(self, owner: str) -> memoryview:
        """``owner``'s file mapped, as long as the segment: chunks at their offsets."""
        return self._file(owner).view

    def chunk_file(self, file_id: int) -> tuple[str, Path] | None:
        """The account and path of the file with id ``file_id``; None if there is none
        (for the door, which opens the path and checks the inode again)."""
        found = self._by_id.get(file_id)
        return None if found is None else (found.owner, found.path)

    # ---------------------------------------------------------------- memory

    def take(self, owner: str, offset: int, length: int) -> None:
        """Give ``owner``'s file memory for ``length`` bytes at ``offset`` (a chunk placed):
        :class:`ChunkFilesFull` if the filesystem has no room."""
        fd = self._file(owner).fd
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as error:
            self._punch(self._by_owner[owner], offset, length)  # what it did take
            raise ChunkFilesFull(
                error.errno,
                f"no room in {self.directory.parent} for {length} bytes of chunks "
                f"({error.strerror}): is the shared-memory filesystem large enough?",
            ) from None
        self._given[owner] = self._given.get(owner, 0) + length

    def give_back(self, owner: str, offset: int, length: int) -> None:
        """Free the memory of ``length`` bytes at ``offset`` in ``owner``'s file (a hole)."""
        found = self._by_owner.get(owner)
        if found is not None:
            self._punch(found, offset, length)
            self._given[owner] -= length

    def allocated_bytes(self, owner: str) -> int:
        """The memory ``owner``'s file holds."""
        found = self._by_owner.get(owner)
        return 0 if found is None else os.fstat(found.fd).st_blocks * 512

    def strays(self) -> list[str]:
        """The accounts whose files hold more memory than their chunks were given: a client
        that maps its file read-write can fault pages into its holes (they are charged to
        its own memory cgroup, and :meth:`trim` gives them back)."""
        return [
            owner
            for owner in self._by_owner
            if self.allocated_bytes(owner) > self._given.get(owner, 0)
        ]

    def trim(self, owner: str, kept: list[tuple[int, int]]) -> None:
        """Free the memory of ``owner``'s file outside the ``kept`` (offset, length) runs
        (sorted, not overlapping); from now on they are all it was given."""
        found = self._by_owner.get(owner)
        if found is None:
            return
        self._given[owner] = sum(length for _, length in kept)
        for start, end in _gaps(_data_runs(found.fd), kept):
            self._punch(found, start, end - start)

    @staticmethod
    def _punch(found: _File, offset: int, length: int) -> None:
        found.mapping.madvise(mmap.MADV_REMOVE, offset, length)

    # -------------------------------------------------------------- lifetime

    def close(self) -> None:
        for found in self._by_owner.values():
            found.view.release()
            found.mapping.close()
            os.close(found.fd)
        self._by_owner.clear()
        self._by_id.clear()

    def _file(self, owner: str) -> _File:
        """``owner``'s file: mapped already, or adopted, or made (as long as the segment)."""
        found = self._by_owner.get(owner)
        if found is not None:
            return found
        with self._making:  # threads of the agent's edges may ask for a new owner at once
            found = self._by_owner.get(owner)
            return found if found is not None else self._make(owner)

    def _make(self, owner: str) -> _File:
        path = self.directory / file_name(owner)
        try:
            fd = create_exclusive(path, FILE_MODE)
        except FileExistsError:
            return self._adopt(owner)
        try:
            os.ftruncate(fd, self.size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return self._add(owner, path, fd)

    def _adopt(self, owner: str) -> _File:
        path = self.directory / file_name(owner)
        fd, status = open_verified(path, what="chunk file", mode=FILE_MODE, flags=os.O_RDWR)
        if status.st_size != self.size:
            os.close(fd)
            raise FileRefused(
                f"refusing chunk file {path}: {status.st_size} bytes, not the segment's "
                f"{self.size}; remove it"
            )
        assert stat.S_ISREG(status.st_mode)
        return self._add(owner, path, fd)

    def _add(self, owner: str, path: Path, fd: int) -> _File:
        try:
            mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        found = _File(owner, path, fd, os.fstat(fd).st_ino, mapping, memoryview(mapping))
        self._by_owner[owner] = found
        self._by_id[found.file_id] = found
        return found


def _data_runs(fd: int) -> list[tuple[int, int]]:
    """The [start, end) runs of a sparse file that hold memory (``SEEK_DATA``/``SEEK_HOLE``)."""
    runs: list[tuple[int, int]] = []
    position = 0
    while True:
        try:
            start = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:  # no data after position
                return runs
            raise
        position = os.lseek(fd, start, os.SEEK_HOLE)
        runs.append((start, position))


def _gaps(runs: list[tuple[int, int]], kept: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The parts of the [start, end) ``runs`` that no (offset, length) run of ``kept``
    covers; both sorted, in one pass."""
    first = 0
    for start, end in runs:
        while first < len(kept) and sum(kept[first]) <= start:
            first += 1
        position, index = start, first
        while index < len(kept) and kept[index][0] < end:
            offset, length = kept[index]
            if offset > position:
                yield position, offset
            position = max(position, offset + length)
            index += 1
        if position < end:
            yield position, end
