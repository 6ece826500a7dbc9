"""NVMe tier: restarts, crash leftovers, capacity and quota eviction, fsync, O_DIRECT."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool.agent.l2 import L2Object, ObjectKey
from kvpool.agent.l2.codec import HEADER
from kvpool.agent.l2.nvme import NvmeAdapter
from kvpool.agent.l2.nvme_files import BLOCK
from kvpool.common.files import FileRefused
from tests.support.local_user import NOBODY, needs_root

from .conftest import POOL, MiB, chunk, nvme_config, object_codec, payload

pytestmark = pytest.mark.asyncio

SIZE = 10_000
FILE = HEADER.size + SIZE  # bytes on disk for a SIZE payload (buffered I/O)


def _adapter(
    path: Path, limits: dict[str, int | None] | None = None, **overrides: Any
) -> NvmeAdapter:
    quotas = limits or {}
    codec = object_codec(path.parent / f"{path.name}-keys")
    return NvmeAdapter(nvme_config(path, **overrides), POOL, quotas.get, codec)


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


async def _put(adapter: NvmeAdapter, *names: ObjectKey, size: int = SIZE) -> list[bool]:
    return await adapter.put([L2Object(n, payload(size, n.key.hex())) for n in names])


async def test_a_restarted_adapter_serves_what_the_last_one_stored(tmp_path: Path) -> None:
    first = _adapter(tmp_path)
    names = [chunk(i, tenant) for i in range(5) for tenant in ("tenant-a", "tenant-b")]
    await _put(first, *names)
    used, tenant_a = first.stats.used_bytes, first.tenant_used("tenant-a")
    await first.close()

    second = _adapter(tmp_path)
    assert second.stats.used_bytes == used == len(names) * FILE
    assert second.tenant_used("tenant-a") == tenant_a == 5 * FILE
    assert await second.get(names) == [payload(SIZE, n.key.hex()) for n in names]
    await second.close()


async def test_the_lru_order_survives_a_restart_and_follows_hits(tmp_path: Path) -> None:
    first = _adapter(tmp_path, capacity=3 * FILE)
    names = [chunk(i) for i in range(3)]
    await _put(first, *names)
    for age, name in enumerate(names):  # chunk 0 oldest; coarse mtimes could tie
        os.utime(first.path_of(name), ns=(0, (10 + age) * 10**9))
    await first.get([names[0]])  # a hit makes chunk 0 the most recent, on disk too
    await first.close()

    second = _adapter(tmp_path, capacity=3 * FILE)
    assert await _put(second, chunk(3)) == [True]
    assert await second.exists([*names, chunk(3)]) == [True, False, True, True]
    await second.close()


async def test_start_removes_crash_leftovers_and_ignores_strangers(tmp_path: Path) -> None:
    first = _adapter(tmp_path)
    name = chunk(0)
    await _put(first, name)
    await first.close()
    path = first.path_of(name)
    half_written = path.with_name(f".tmp-{path.name}-0badc0de")
    half_written.write_bytes(b"half a chunk")
    probe = first.root / ".tmp-direct-io-probe"
    probe.write_bytes(b"")
    stranger = path.with_name("README")
    stranger.write_bytes(b"not a chunk")

    second = _adapter(tmp_path)
    assert not half_written.exists() and not probe.exists()
    assert stranger.exists()
    assert second.stats.used_bytes == FILE
    assert await second.get([name]) == [payload(SIZE, name.key.hex())]
    await second.close()


async def test_capacity_evicts_least_recently_used_files(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, capacity=4 * FILE)
    names = [chunk(i) for i in range(6)]
    await _put(adapter, *names[:4])
    await adapter.get([names[0]])  # chunk 1 is now the least recently used
    assert await _put(adapter, names[4]) == [True]
    assert await adapter.exists(names[:5]) == [True, False, True, True, True]
    await _put(adapter, names[5])
    assert await adapter.exists(names) == [True, False, False, True, True, True]
    assert adapter.stats.evictions == 2
    assert adapter.stats.used_bytes == 4 * FILE
    assert sum(p.stat().st_size for p in _files(adapter.root)) == adapter.stats.used_bytes
    await adapter.close()


async def test_capacity_eviction_skips_the_files_of_chunks_pinned_in_l1(tmp_path: Path) -> None:
    names = [chunk(i) for i in range(6)]
    pinned = {names[0], names[1]}
    codec = object_codec(tmp_path / "keys")
    config = nvme_config(tmp_path / "l2", capacity=4 * FILE)
    adapter = NvmeAdapter(config, POOL, lambda tenant: None, codec, pinned.__contains__)
    await _put(adapter, *names[:4])
    assert await _put(adapter, *names[4:]) == [True, True]  # 2 and 3 go, not 0 and 1
    assert await adapter.exists(names) == [True, True, False, False, True, True]
    pinned.update(names[4:])  # everything pinned: a new file finds no room
    assert await _put(adapter, chunk(9)) == [False]
    await adapter.close()


async def test_a_tenant_over_its_quota_evicts_only_its_own_files(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, limits={"small": 2 * FILE}, capacity=100 * FILE)
    big = [chunk(i, "big") for i in range(5)]
    small = [chunk(i, "small") for i in range(4)]
    await _put(adapter, *big[:3])
    await _put(adapter, *small[:2])
    await _put(adapter, *big[3:])  # the newest files are big's
    await _put(adapter, small[2])
    await _put(adapter, small[3])
    assert await adapter.exists(small) == [False, False, True, True]
    assert await adapter.exists(big) == [True] * 5
    assert adapter.tenant_used("small") == 2 * FILE
    assert adapter.tenant_used("big") == 5 * FILE
    await adapter.close()


async def test_refused_puts_write_nothing(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, limits={"none": 0, "tiny": FILE - 1}, capacity=4 * FILE)
    assert await _put(adapter, chunk(0, "none"), chunk(0, "tiny")) == [False, False]
    assert await _put(adapter, chunk(0), size=4 * FILE) == [False]  # larger than the tier
    assert adapter.stats.put_failures == 3
    assert adapter.stats.used_bytes == 0
    assert _files(adapter.root) == []
    await adapter.close()


async def test_corrupt_files_are_misses_and_deleted(tmp_path: Path) -> None:
    first = _adapter(tmp_path)
    names = [chunk(i) for i in range(4)]
    await _put(first, *names)
    await first.close()
    paths = [first.path_of(n) for n in names]
    with paths[0].open("r+b") as file:  # truncated
        file.truncate(FILE - 1)
    paths[1].write_bytes(b"\0" * FILE)  # garbage
    # Another tenant's intact file under this tenant's name: the header tells them apart.
    intruder = ObjectKey("tenant-b", names[2].key)
    first.path_of(intruder).parent.mkdir(parents=True)
    shutil.copy(paths[2], first.path_of(intruder))
    last_byte_flipped = bytearray(paths[3].read_bytes())
    last_byte_flipped[-1] ^= 1
    paths[3].write_bytes(last_byte_flipped)
    second = _adapter(tmp_path)
    intact = payload(SIZE, names[2].key.hex())
    assert await second.get([*names, intruder]) == [None, None, intact, None, None]
    assert second.stats.integrity_failures == 4
    assert not any(p.exists() for p in (paths[0], paths[1], paths[3], first.path_of(intruder)))
    assert second.stats.used_bytes == FILE
    await second.close()


async def test_racing_operations_on_one_key_keep_the_index_true_to_the_disk(
    tmp_path: Path,
) -> None:
    adapter = _adapter(tmp_path)
    name, data = chunk(0), payload(SIZE)
    for _ in range(20):
        results = await asyncio.gather(
            adapter.put([L2Object(name, data)]),
            adapter.delete([name]),
            adapter.get([name]),
            adapter.put([L2Object(name, data)]),
        )
        assert results[2] in ([data], [None])
        on_disk = _files(adapter.root)
        assert adapter.stats.used_bytes == sum(p.stat().st_size for p in on_disk)
        assert await adapter.exists([name]) == [bool(on_disk)] == [True]
    await adapter.close()


@pytest.mark.parametrize(("fsync", "file_syncs", "dir_syncs"), [("never", 0, 0), ("data", 1, 0)])
async def test_fsync_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str, file_syncs: int, dir_syncs: int
) -> None:
    adapter = _adapter(tmp_path, fsync=fsync)
    calls = _spy_syncs(monkeypatch)
    await _put(adapter, chunk(0))
    assert calls == {"fdatasync": file_syncs, "fsync": dir_syncs}
    await adapter.close()


async def test_fsync_always_also_syncs_the_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = _adapter(tmp_path, fsync="always")
    calls = _spy_syncs(monkeypatch)
    await _put(adapter, chunk(0))
    # The file, its directory, and the two directories created for it.
    assert calls == {"fdatasync": 1, "fsync": 3}
    await _put(adapter, chunk(1, "tenant-a"))
    assert calls["fdatasync"] == 2 and calls["fsync"] >= 4
    await adapter.close()


def _spy_syncs(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"fdatasync": 0, "fsync": 0}

    def spy(name: str, real: Callable[[int], None]) -> Callable[[int], None]:
        def counted(fd: int) -> None:
            calls[name] += 1
            real(fd)

        return counted

    monkeypatch.setattr(os, "fdatasync", spy("fdatasync", os.fdatasync))
    monkeypatch.setattr(os, "fsync", spy("fsync", os.fsync))
    return calls


async def test_direct_io_writes_whole_blocks_and_round_trips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = _adapter(tmp_path, direct_io=True)
    if not adapter.direct_io:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    flags: list[int] = []
    real_open = os.open

    def recording_open(path: Any, flag: int, *args: Any, **kwargs: Any) -> int:
        flags.append(flag)
        return real_open(path, flag, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    sizes = [0, 1, BLOCK - HEADER.size, BLOCK, MiB + 1]
    names = [chunk(size) for size in sizes]
    assert await adapter.put([L2Object(n, payload(s)) for n, s in zip(names, sizes, strict=True)])
    files = [flag for flag in flags if not flag & os.O_DIRECTORY]  # not its directories' checks
    assert files and all(flag & os.O_DIRECT for flag in files)
    assert all(adapter.path_of(n).stat().st_size % BLOCK == 0 for n in names)
    assert adapter.stats.used_bytes == sum(p.stat().st_size for p in _files(adapter.root))
    assert await adapter.get(names) == [payload(s) for s in sizes]
    await adapter.close()

    restarted = _adapter(tmp_path, direct_io=True)
    assert await restarted.get(names) == [payload(s) for s in sizes]
    await restarted.close()


async def test_direct_io_falls_back_where_the_filesystem_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Simulated: tmpfs refused O_DIRECT before Linux 6.6, and no test may mount a filesystem.
    real_open = os.open

    def refusing_open(path: Any, flag: int, *args: Any, **kwargs: Any) -> int:
        if flag & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flag, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with caplog.at_level(logging.WARNING, logger="kvpool.agent.l2.nvme"):
        adapter = _adapter(tmp_path, direct_io=True)
    assert not adapter.direct_io
    assert "refuses O_DIRECT (Invalid argument)" in caplog.text
    assert await _put(adapter, chunk(0)) == [True]
    assert adapter.path_of(chunk(0)).stat().st_size == FILE
    assert await adapter.get([chunk(0)]) == [payload(SIZE, chunk(0).key.hex())]
    await adapter.close()


def _modes(root: Path) -> dict[str, set[str]]:
    """The modes of the tree's directories (the root's included) and of its files."""
    found: dict[str, set[str]] = {"directories": {f"{stat.S_IMODE(root.stat().st_mode):04o}"}}
    for path in root.rglob("*"):
        kind = "directories" if path.is_dir() else "files"
        found.setdefault(kind, set()).add(f"{stat.S_IMODE(path.stat().st_mode):04o}")
    return found


async def test_the_tree_is_the_agents_alone_whatever_the_umask(tmp_path: Path) -> None:
    """0755 directories let every local user list every tenant id and chunk key."""
    previous = os.umask(0)
    try:
        adapter = _adapter(tmp_path / "nvme")
        assert await _put(adapter, *[chunk(i, tenant) for i in range(4) for tenant in "ab"])
    finally:
        os.umask(previous)
    await adapter.close()
    assert _modes(adapter.root) == {"directories": {"0700"}, "files": {"0600"}}


async def test_wider_directories_an_older_agent_left_are_narrowed_at_start(
    tmp_path: Path,
) -> None:
    first = _adapter(tmp_path)
    names = [chunk(i) for i in range(3)]
    await _put(first, *names)
    await first.close()
    for path in [first.root, *first.root.rglob("*")]:
        if path.is_dir():
            path.chmod(0o755)
    second = _adapter(tmp_path)
    assert _modes(second.root)["directories"] == {"0700"}
    assert await second.get(names) == [payload(SIZE, n.key.hex()) for n in names]
    await second.close()


@pytest.mark.root
@needs_root
async def test_a_tree_of_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / POOL
    root.mkdir(mode=0o777)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(FileRefused) as refused:
        _adapter(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"refusing NVMe tier directory {root}: it belongs to another user")
    assert f"(owner uid {NOBODY}, mode {stat.S_IMODE(root.stat().st_mode):04o})" in message


@pytest.mark.root
@needs_root
async def test_what_another_user_put_in_the_tree_is_never_served_or_written_into(
    tmp_path: Path,
) -> None:
    first = _adapter(tmp_path)
    names = [chunk(0), chunk(1, "tenant-b")]
    await _put(first, *names)
    await first.close()
    theirs = first.path_of(names[0])
    os.chown(theirs, NOBODY, NOBODY)  # a file of theirs, at a chunk's very name
    os.chown(first.path_of(names[1]).parent, NOBODY, NOBODY)  # a shard directory of theirs
    second = _adapter(tmp_path)
    assert second.stats.used_bytes == 0
    assert await second.get(names) == [None, None]
    assert await _put(second, names[1]) == [False]  # its shard is not the agent's
    await second.close()
