"""The segment and shm checks: this pod maps the agent's segment, on a big enough /dev/shm.

Where it cannot, the connector moves KV through the agent's messages instead (slower), so
those findings are WARN, with the fix; a segment replaced under its live agent is a FAIL
(the agent's state is wrong, whoever maps its path).

The connector maps the path its settings or the Service name, else the one the agent's
hello names. That file must exist here, be the agent's (its size, and the very file the
agent maps: the hello names its device and inode), and be mappable read-write by this
uid; the file system that holds it must hold the whole segment (``l1_size`` and the
header).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvpool_agent.client import AgentInfo
from kvpool_agent.doctor.report import Check, failed, passed, size, skipped, warned
from kvpool_agent.segment import SegmentError, SharedSegment

SEGMENT, SHM = "segment", "shm"

OTHER_FILE = (
    "this pod must map the agent's segment: mount the node's /dev/shm at the path the agent "
    "uses, and drop a segment_path / KVPOOL_SEGMENT_PATH / --segment-path that names another "
    "file"
)
_MOUNT_THE_NODES_SHM = (
    "mount the node's /dev/shm into the vLLM pod (volumes: [{name: kvpool-shm, hostPath: "
    "{path: /dev/shm, type: Directory}}], volumeMounts: [{name: kvpool-shm, mountPath: "
    "/dev/shm}]), and set no segment_path / KVPOOL_SEGMENT_PATH unless it is mounted elsewhere"
)


def check_segment(path: Path, info: AgentInfo) -> tuple[Check, SharedSegment | None]:
    """Map ``path`` as the connector does; the mapping if it is the agent's segment."""
    expected = info.data_offset + info.data_size
    try:
        found = path.stat()
    except OSError as error:
        return warned(SEGMENT, f"{path}: {error.strerror} in this pod", _MOUNT_THE_NODES_SHM), None
    if not stat.S_ISREG(found.st_mode):
        return warned(
            SEGMENT,
            f"{path} is not a file (mode {stat.filemode(found.st_mode)})",
            _MOUNT_THE_NODES_SHM,
        ), None
    if found.st_size != expected:
        return warned(
            SEGMENT,
            f"{path} has {found.st_size} bytes; the agent's segment ({info.segment_path}) has "
            f"{expected}: this pod sees another file",
            _MOUNT_THE_NODES_SHM,
        ), None
    uid = os.geteuid()
    try:
        mapped = SharedSegment.attach(path, populate=True)
    except SegmentError as error:
        return warned(
            SEGMENT,
            f"uid {uid} cannot map {path} read-write: {error} (owner uid {found.st_uid}, "
            f"gid {found.st_gid}, mode {stat.filemode(found.st_mode)})",
            f"run vLLM as uid {found.st_uid} (securityContext.runAsUser), or in group "
            f"{found.st_gid} (runAsGroup or supplementalGroups) with the file group-writable",
        ), None
    if (mapped.layout.data_offset, mapped.layout.data_size) != (info.data_offset, info.data_size):
        mapped.close()
        return warned(
            SEGMENT,
            f"{path} holds a segment of another layout than the agent's "
            f"({mapped.layout.data_size} data bytes at {mapped.layout.data_offset}, the agent "
            f"{info.data_size} at {info.data_offset}): this pod sees another file",
            _MOUNT_THE_NODES_SHM,
        ), None
    other = _another_file(path, mapped, info)
    if other is not None:
        mapped.close()
        return other, None
    return passed(
        SEGMENT,
        f"{path}: {size(expected)}, the agent's size, mapped read-write as uid {uid}"
        + (", the very file the agent maps" if any(info.segment_identity) else ""),
    ), mapped


def _another_file(path: Path, mapped: SharedSegment, info: AgentInfo) -> Check | None:
    """A FAIL if the file mapped here is not the one the agent maps (where it says which)."""
    if not any(info.segment_identity) or mapped.identity == info.segment_identity:
        return None
    here, agents = _file(mapped.identity), _file(info.segment_identity)
    if path == info.segment_path:
        return failed(
            SEGMENT,
            f"{path} here is {here}, but the agent maps {agents}: the file at its path was "
            "replaced or removed since the agent started, and whoever maps the path sees "
            "other bytes than the agent",
            "restart the agent (it adopts the file at its path) and find what replaced the "
            "segment: another agent of the pool (one that predates the segment's owner lock) "
            "or a person",
        )
    return warned(
        SEGMENT,
        f"this pod maps {path} ({here}); the agent maps its segment {info.segment_path} "
        f"({agents}): they are different files",
        OTHER_FILE,
    )


def _file(identity: tuple[int, int]) -> str:
    device, inode = identity
    return f"file {os.major(device)}:{os.minor(device)} inode {inode}"


def unmapped() -> list[Check]:
    """The segment and shm lines of a pod set not to map the segment (the transport
    ``messages``)."""
    return [
        passed(
            SEGMENT,
            "not mapped here (transport=messages): the pool gives the node's segment, which "
            "holds every tenant's KV, only to pods of its spec.engineNamespaces",
        ),
        skipped(SHM, "no segment is mapped here (transport=messages)"),
    ]


def check_shm(path: Path, info: AgentInfo) -> Check:
    """The file system holding ``path`` has room for the whole segment."""
    directory = path.parent
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    found = os.statvfs(directory)
    total, free = found.f_blocks * found.f_frsize, found.f_bavail * found.f_frsize
    needed = info.data_offset + info.data_size
    seen = (
        f"{directory}: {size(total)} in all, {size(free)} free; the segment takes {size(needed)} "
        f"(l1_size {size(info.data_size)} and its header)"
    )
    if total < needed:
        return warned(
            SHM,
            seen,
            f"{directory} here is not the node's /dev/shm (a pod's own is small): "
            f"{_MOUNT_THE_NODES_SHM}; else grow the node's /dev/shm or lower the pool's "
            "spec.l1.size (the agent's l1_size)",
        )
    return passed(SHM, seen)
