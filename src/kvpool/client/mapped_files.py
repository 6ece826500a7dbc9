"""The chunk files a client maps: each got once from the agent's door, by its id.

A reply of the agent that locates chunks (a lookup's hits, a store's reserved offsets) names
the chunk file they are in (:mod:`kvpool.common.chunk_files`). :class:`MappedChunkFiles`
asks the door (:func:`kvpool.common.door.open_chunk_file`) for a file it has not mapped yet,
with the client's token, and maps it as the door gave it: read-write (the token's own
tenant, or any for an engine's) or read-only (a shared space of a tenant's token). A client
never opens a chunk file by path, and maps no file its token may not.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.common.door import DoorError, open_chunk_file


class ChunkFileError(RuntimeError):
    """A chunk file cannot be mapped (the door refused it, or it is not what was asked)."""


@dataclass
class MappedFile:
    file_id: int
    owner: str
    """The account the file holds the chunks of (a tenant or a shared space)."""
    writable: bool
    mapping: mmap.mmap
    view: memoryview = field(init=False)

    def __post_init__(self) -> None:
        self.view = memoryview(self.mapping)

    def close(self) -> None:
        self.view.release()
        self.mapping.close()


class MappedChunkFiles:
    """The chunk files mapped in this process through the door at ``door``."""

    def __init__(self, door: Path, token: str, timeout: float = 5.0) -> None:
        self.door = door
        self._token = token
        self._timeout = timeout
        self._files: dict[int, MappedFile] = {}

    def get(self, file_id: int) -> MappedFile:
        """The file ``file_id``, mapped (asking the door the first time):
        :class:`ChunkFileError` if it cannot be."""
        found = self._files.get(file_id)
        if found is not None:
            return found
        if file_id <= 0:
            raise ChunkFileError(f"no chunk file has id {file_id}")
        try:
            opened = open_chunk_file(self.door, self._token, file_id, self._timeout)
        except DoorError as error:
            raise ChunkFileError(str(error)) from None
        try:
            size = os.fstat(opened.fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if opened.writable else 0)
            mapping = mmap.mmap(opened.fd, size, flags=mmap.MAP_SHARED, prot=prot)
        except OSError as error:
            raise ChunkFileError(
                f"cannot map chunk file {file_id} from {self.door}: {error}"
            ) from None
        finally:
            os.close(opened.fd)
        found = MappedFile(file_id, opened.owner, opened.writable, mapping)
        self._files[file_id] = found
        return found

    def chunk(self, file_id: int, offset: int, size: int, *, write: bool = False) -> memoryview:
        """``size`` bytes at ``offset`` of the file ``file_id`` (``write``: to be written,
        :class:`ChunkFileError` if the file is mapped read-only)."""
        return self.check(file_id, offset, size, write=write).view[offset : offset + size]

    def check(self, file_id: int, offset: int, size: int, *, write: bool = False) -> MappedFile:
        """The file ``file_id``, mapped, once ``size`` bytes at ``offset`` are known to lie
        in it (and, with ``write``, that it is writable): else :class:`ChunkFileError`."""
        found = self.get(file_id)
        if write and not found.writable:
            raise ChunkFileError(
                f"chunk file {file_id} ({found.owner}) is read-only for this token"
            )
        if offset < 0 or offset + size > len(found.mapping):
            raise ChunkFileError(f"chunk at {offset}+{size} lies outside chunk file {file_id}")
        return found

    def close(self) -> None:
        """Unmap every file (copies out of them must have ended)."""
        for found in self._files.values():
            found.close()
        self._files.clear()
