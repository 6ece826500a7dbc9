"""The NVMe tier's start: the chunk files its tree holds, least recently used first.

After a restart the LRU order is the files' mtime order (a hit touches the mtime).
The scan removes the temp files a crash left (of a write, or of the O_DIRECT probe) and
narrows a directory of the tree that an older agent left wider. What is not a chunk file
of the agent's own is left alone as a stranger, never served or replaced: a directory or
file of another user, or any other name.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvpool.agent.l2 import layout
from kvpool.agent.l2.base import ObjectKey
from kvpool.agent.l2.nvme_files import DIRECTORY_MODE, TEMP_PREFIX, ChunkFiles, log
from kvpool.common.files import FileRefused


def scan(files: ChunkFiles) -> list[tuple[ObjectKey, int]]:
    """Each chunk file under ``files.root`` and its size, least recently used first.

    Runs on the constructor's thread (no loop yet), and logs what it found.
    """
    found: list[tuple[int, ObjectKey, int]] = []
    temps = strays = narrowed = 0
    uid = os.geteuid()
    for tenant_dir in os.scandir(files.root):
        if tenant_dir.name.startswith(TEMP_PREFIX):  # a crash during the O_DIRECT probe
            Path(tenant_dir.path).unlink(missing_ok=True)
            temps += 1
        elif tenant_dir.is_dir(follow_symlinks=False):
            try:
                narrowed += files.ensure_own_dir(Path(tenant_dir.path))
            except FileRefused as error:
                log.warning("NVMe tier: ignored: %s", error)
                strays += 1
                continue
            for shard in os.scandir(tenant_dir.path):
                if not shard.is_dir(follow_symlinks=False):
                    strays += 1
                    continue
                try:
                    narrowed += files.ensure_own_dir(Path(shard.path))
                except FileRefused as error:
                    log.warning("NVMe tier: ignored: %s", error)
                    strays += 1
                    continue
                for entry in os.scandir(shard.path):
                    if entry.name.startswith(TEMP_PREFIX):
                        Path(entry.path).unlink(missing_ok=True)
                        temps += 1
                        continue
                    name = _parse(tenant_dir.name, shard.name, entry.name)
                    if name is None or not entry.is_file(follow_symlinks=False):
                        strays += 1
                        continue
                    stat = entry.stat(follow_symlinks=False)
                    if stat.st_uid != uid:  # not the agent's: never served, never replaced
                        strays += 1
                        continue
                    found.append((stat.st_mtime_ns, name, stat.st_size))
    found.sort(key=lambda item: item[0])
    if narrowed:
        log.info(
            "NVMe tier %s: %d directories narrowed to mode %04o (other users could list them)",
            files.root,
            narrowed,
            DIRECTORY_MODE,
        )
    log.info(
        "NVMe tier %s: %d files, %d bytes; removed %d temp files, ignored %d other entries",
        files.root,
        len(found),
        sum(size for _, _, size in found),
        temps,
        strays,
    )
    return [(name, size) for _, name, size in found]


def _parse(tenant: str, shard: str, filename: str) -> ObjectKey | None:
    """The chunk whose file this is, or None for a name the layout never gives a chunk."""
    try:
        name = ObjectKey(tenant, bytes.fromhex(filename))
    except ValueError:
        return None
    valid = layout.is_valid(name) and layout.relative_path(name) == f"{tenant}/{shard}/{filename}"
    return name if valid else None
