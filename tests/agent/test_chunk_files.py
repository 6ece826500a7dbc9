"""Chunk files: each account's memory follows its chunks, and what a client adds is taken back."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_agent.chunk_files import (
    ChunkFiles,
    ChunkFilesFull,
    file_name,
    files_directory,
    owner_of,
)
from kvpool_agent.core.l1 import L1Cache
from kvpool_agent.core.policies import policy_factory
from kvpool_agent.core.quota_book import QuotaBook
from kvpool_agent.segment import SegmentLayout

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


def test_an_account_holds_memory_only_for_its_chunks(directory: Path) -> None:
    files = ChunkFiles.open(directory, 64 * MIB, adopt=False)
    assert files.file_id("a") == 0  # no file before its first chunk
    files.take("a", 8 * MIB, 4 * MIB)
    files.take("b", 16 * MIB, 2 * MIB)
    assert files.allocated_bytes("a") == 4 * MIB
    assert files.allocated_bytes("b") == 2 * MIB
    files.view("a")[8 * MIB : 8 * MIB + 5] = b"hello"
    files.give_back("a", 8 * MIB, 4 * MIB)
    assert files.allocated_bytes("a") == 0
    with open(directory / file_name("a"), "rb") as handle:  # read(), not a fault: a hole
        assert os.pread(handle.fileno(), 5, 8 * MIB) == bytes(5)
    assert files.strays() == []
    files.close()


def test_files_are_the_agent_s_alone_and_named_after_their_account(directory: Path) -> None:
    files = ChunkFiles.open(directory, 8 * MIB, adopt=False)
    files.take("tenant-a", 0, PAGE)
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
    files = ChunkFiles.open(directory, 64 * MIB, adopt=False)
    files.take("a", 8 * MIB, 2 * MIB)
    # a pod that maps its file read-write writes outside its chunks
    with open(directory / file_name("a"), "r+b") as handle:
        handle.seek(40 * MIB)
        handle.write(os.urandom(3 * MIB))
    assert files.strays() == ["a"]
    files.trim("a", [(8 * MIB, 2 * MIB)])
    assert files.allocated_bytes("a") == 2 * MIB
    assert files.strays() == []
    files.close()


def test_a_full_filesystem_refuses_the_chunk_and_keeps_nothing(directory: Path) -> None:
    files = ChunkFiles.open(directory, 1 << 42, adopt=False)  # larger than any tmpfs here
    with pytest.raises(ChunkFilesFull, match="shared-memory filesystem large enough"):
        files.take("a", 0, 1 << 41)
    assert files.allocated_bytes("a") == 0
    files.close()


def test_adopted_files_keep_their_bytes_and_new_ones_start_empty(directory: Path) -> None:
    files = ChunkFiles.open(directory, 8 * MIB, adopt=False)
    files.take("a", MIB, PAGE)
    files.view("a")[MIB : MIB + 4] = b"kept"
    first_id = files.file_id("a")
    files.close()
    adopted = ChunkFiles.open(directory, 8 * MIB, adopt=True)
    assert adopted.owners() == ["a"]
    assert adopted.file_id("a") == first_id
    assert bytes(adopted.view("a")[MIB : MIB + 4]) == b"kept"
    adopted.close()
    fresh = ChunkFiles.open(directory, 8 * MIB, adopt=False)
    assert fresh.owners() == [] and not any(directory.iterdir())
    fresh.close()


def _cache(files: ChunkFiles, pages: int) -> L1Cache:
    layout = SegmentLayout.plan(pages * PAGE, PAGE)
    return L1Cache(
        layout,
        policy_factory("lru"),
        QuotaBook(default=None),
        high_watermark=1.0,
        low_watermark=0.9,
        backing=files,
    )


def test_l1_gives_each_chunk_s_pages_to_its_tenant_and_back(directory: Path) -> None:
    layout = SegmentLayout.plan(16 * PAGE, PAGE)
    files = ChunkFiles.open(directory, layout.total_size, adopt=False)
    cache = _cache(files, 16)
    reservation = cache.reserve("a", [b"a" * 32], [3 * PAGE - 5])
    assert reservation.lease is not None
    cache.commit(reservation.lease)
    cache.reserve("b", [b"b" * 32], [PAGE])
    assert files.allocated_bytes("a") == 3 * PAGE
    assert files.allocated_bytes("b") == PAGE
    cache.clear("a")
    assert files.allocated_bytes("a") == 0
    files.close()


def test_l1_refuses_a_store_the_filesystem_has_no_room_for(directory: Path) -> None:
    class Full(ChunkFiles):
        def take(self, owner: str, offset: int, length: int) -> None:
            raise ChunkFilesFull(28, "no room in /dev/shm for chunks")

    layout = SegmentLayout.plan(16 * PAGE, PAGE)
    files = Full.open(directory, layout.total_size, adopt=False)
    cache = _cache(files, 16)
    reservation = cache.reserve("a", [b"a" * 32], [PAGE])
    assert reservation.lease is None
    assert reservation.refused_reason == "no room in /dev/shm for chunks"
    assert cache.stats().allocated_bytes == 0  # the pages allocated for it are free again
    files.close()
