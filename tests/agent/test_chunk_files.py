"""Chunk files: each account's memory follows its chunks, and what a client adds is taken back."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent.core.l1 import L1Cache
from kvpool.agent.core.policies import policy_factory
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.common.chunk_files import (
    ChunkFiles,
    ChunkFilesFull,
    file_name,
    files_directory,
    owner_of,
)
from kvpool.common.segment import SegmentLayout

MIB = 1 << 20
PAGE = 64 << 10


@pytest.fixture
def directory(tmp_path: Path) -> Iterator[Path]:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else tmp_path
    path = files_directory(base / f"kvpool-test-{os.getpid()}-{tmp_path.name}")
    yield path
    if path.is_dir():
        for entry in path.iterdir():
            entry.unlink()
        path.rmdir()


def _open(directory: Path, size: int, *, adopt: bool = False) -> ChunkFiles:
    return ChunkFiles.open(directory, size, PAGE, PAGE, adopt=adopt)


def _read(directory: Path, owner: str, offset: int, length: int) -> bytes:
    """What ``owner``'s file holds there, read() rather than faulted in (a hole stays one)."""
    with open(directory / file_name(owner), "rb") as handle:
        return os.pread(handle.fileno(), length, offset)


def test_each_page_is_held_by_one_account_s_file_at_most(directory: Path) -> None:
    files = _open(directory, 64 * MIB)
    assert files.file_id("a") == 0  # no file before its first chunk
    files.take("a", 8 * MIB, 4 * MIB)
    files.take("b", 16 * MIB, 2 * MIB)
    assert files.allocated_bytes("a") == files.held_bytes("a") == 4 * MIB
    assert files.allocated_bytes("b") == files.held_bytes("b") == 2 * MIB
    files.view("a")[9 * MIB : 9 * MIB + 6] = b"secret"
    files.take("a", 8 * MIB, 4 * MIB)  # its own pages already: nothing moves
    assert files.allocated_bytes("a") == 4 * MIB
    files.take("b", 9 * MIB, MIB)  # a page of a's goes to b: punched out of a's file
    assert files.allocated_bytes("a") == files.held_bytes("a") == 3 * MIB
    assert files.allocated_bytes("b") == 3 * MIB
    assert _read(directory, "a", 9 * MIB, 6) == bytes(6)
    assert _read(directory, "b", 9 * MIB, 6) == bytes(6)  # b gets zeros, never a's bytes
    assert files.strays() == []
    files.close()


def test_files_are_the_agent_s_alone_and_named_after_their_account(directory: Path) -> None:
    before = stat.S_IMODE(directory.parent.stat().st_mode)
    files = _open(directory, 8 * MIB)
    assert stat.S_IMODE(directory.parent.stat().st_mode) == before  # not its to change
    files.take("tenant-a", PAGE, PAGE)
    path = directory / file_name("tenant-a")
    status = path.stat()
    assert stat.S_IMODE(status.st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert status.st_ino == files.file_id("tenant-a")
    assert files.chunk_file(status.st_ino) == ("tenant-a", path)
    assert files.chunk_file(status.st_ino + 1) is None
    assert owner_of(path.name) == "tenant-a"
    assert owner_of("not-ours.kv") is None
    files.close()


def test_pages_a_client_writes_into_holes_are_found_and_taken_back(directory: Path) -> None:
    files = _open(directory, 64 * MIB)
    files.take("a", 8 * MIB, 2 * MIB)
    # a pod that maps its file read-write writes outside its pages, and into the header's
    with open(directory / file_name("a"), "r+b") as handle:
        handle.seek(40 * MIB)
        handle.write(os.urandom(3 * MIB))
        handle.seek(0)
        handle.write(b"x")
    assert files.strays() == ["a"]
    files.trim("a")
    assert files.allocated_bytes("a") == files.held_bytes("a") == 2 * MIB
    assert files.strays() == []
    files.close()


def test_a_full_filesystem_refuses_the_chunk_and_keeps_nothing(directory: Path) -> None:
    files = _open(directory, 1 << 42)  # larger than any tmpfs here
    with pytest.raises(ChunkFilesFull, match="shared-memory filesystem large enough"):
        files.take("a", PAGE, 1 << 41)
    assert files.allocated_bytes("a") == files.held_bytes("a") == 0
    files.close()


def test_adopted_files_keep_the_pages_claimed_again_and_new_ones_start_empty(
    directory: Path,
) -> None:
    files = _open(directory, 8 * MIB)
    files.take("a", MIB, 2 * PAGE)
    files.view("a")[MIB : MIB + 4] = b"kept"
    files.view("a")[MIB + PAGE : MIB + PAGE + 4] = b"gone"
    first_id = files.file_id("a")
    files.close()
    adopted = _open(directory, 8 * MIB, adopt=True)
    assert adopted.owners() == ["a"]
    assert adopted.file_id("a") == first_id
    adopted.claim("a", MIB, PAGE)  # the one chunk restored
    adopted.trim_all()
    assert _read(directory, "a", MIB, 4) == b"kept"
    assert adopted.allocated_bytes("a") == adopted.held_bytes("a") == PAGE
    adopted.close()
    fresh = _open(directory, 8 * MIB)
    assert fresh.owners() == [] and not any(directory.iterdir())
    fresh.close()


def _cache(files: ChunkFiles, pages: int) -> L1Cache:
    layout = SegmentLayout.plan(pages * PAGE, PAGE)
    assert (files.size, files.data_offset) == (layout.total_size, layout.data_offset)
    return L1Cache(
        layout,
        policy_factory("lru"),
        QuotaBook(default=None),
        high_watermark=1.0,
        low_watermark=0.9,
        backing=files,
    )


def _files_for(directory: Path, pages: int) -> ChunkFiles:
    layout = SegmentLayout.plan(pages * PAGE, PAGE)
    return ChunkFiles.open(directory, layout.total_size, PAGE, layout.data_offset, adopt=False)


def test_l1_gives_each_chunk_s_pages_to_its_tenant_and_moves_them(directory: Path) -> None:
    files = _files_for(directory, 16)
    cache = _cache(files, 16)
    reservation = cache.reserve("a", [b"a" * 32], [3 * PAGE - 5])
    assert reservation.lease is not None
    cache.commit(reservation.lease)
    cache.reserve("b", [b"b" * 32], [PAGE])
    assert files.allocated_bytes("a") == 3 * PAGE
    assert files.allocated_bytes("b") == PAGE
    cache.clear("a")
    assert files.allocated_bytes("a") == 3 * PAGE  # kept for a's next chunks there
    stored = cache.reserve("b", [bytes([i]) * 32 for i in range(15)], [PAGE] * 15)
    assert stored.lease is not None and stored.refused_reason is None
    assert files.allocated_bytes("a") == 0  # b's chunks took every page
    assert files.allocated_bytes("b") == 16 * PAGE
    files.close()


def test_l1_refuses_a_store_the_filesystem_has_no_room_for(directory: Path) -> None:
    class Full(ChunkFiles):
        def take(self, owner: str, offset: int, length: int) -> None:
            raise ChunkFilesFull(28, "no room in /dev/shm for chunks")

    layout = SegmentLayout.plan(16 * PAGE, PAGE)
    files = Full.open(directory, layout.total_size, PAGE, layout.data_offset, adopt=False)
    cache = _cache(files, 16)
    reservation = cache.reserve("a", [b"a" * 32], [PAGE])
    assert reservation.lease is None
    assert reservation.refused_reason == "no room in /dev/shm for chunks"
    assert cache.stats().allocated_bytes == 0  # the pages allocated for it are free again
    files.close()
