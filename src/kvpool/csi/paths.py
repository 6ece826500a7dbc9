"""Which paths a publish may touch: the target inside the kubelet's pods directory, the
pool's own directory in the node's shared memory, and its door (the subdirectory that holds
the agent's door socket only).

Each check returns the resolved path or raises ValueError with one line naming the value.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from kvpool.common.names import DOOR_DIRECTORY, segment_dir


def target_path(target: str, kubelet_dir: Path) -> Path:
    """``target`` resolved, which must lie in ``<kubelet_dir>/pods/`` (a pod's volume) and
    not be a symlink; its parent may be missing (the kubelet makes it)."""
    pods = Path(os.path.realpath(kubelet_dir / "pods"))
    raw = PurePosixPath(target)
    if not raw.is_absolute() or any(part in ("..", ".") for part in target.split("/")):
        raise ValueError(f"target path {target} must be absolute, without '.' or '..'")
    resolved = Path(os.path.realpath(raw.parent)) / raw.name
    if not resolved.is_relative_to(pods) or resolved.parent == pods:
        raise ValueError(f"target path {target} is not a pod's volume in {pods}")
    if resolved.is_symlink():
        raise ValueError(f"target path {target} is a symlink")
    return resolved


def pool_directory(segment: str, shm_dir: Path, pool: str) -> Path:
    """The directory of the segment at ``segment`` (the pool Service's annotation), which
    must be the pool's own entry of ``shm_dir`` (``kvpool-<pool>``): ``shm_dir`` itself,
    ``/``, another pool's or another program's directory would publish other files.
    ValueError if the path is not that directory; FileNotFoundError if it does not exist
    (yet)."""
    path = PurePosixPath(segment)
    if not path.is_absolute() or ".." in path.parts:
        raise ValueError(f"segment path {segment} must be absolute, without '..'")
    directory = Path(path.parent)
    if directory in (Path("/"), shm_dir) or directory in shm_dir.parents:
        raise ValueError(
            f"segment path {segment} is not in a directory of its own: publishing "
            f"{directory} would expose other files"
        )
    if directory.parent != shm_dir:
        raise ValueError(f"segment path {segment} is not in a directory of {shm_dir}")
    if directory.name != segment_dir(pool).name:
        raise ValueError(
            f"segment path {segment} is not in pool {pool}'s directory "
            f"{shm_dir / segment_dir(pool).name}"
        )
    if directory.is_symlink():
        raise ValueError(f"the pool directory {directory} is a symlink")
    if not directory.exists():
        raise FileNotFoundError(f"the pool directory {directory} does not exist")
    if not directory.is_dir():
        raise ValueError(f"the pool directory {directory} is not a directory")
    return directory


def door_directory(pool_dir: Path) -> Path:
    """The door of the pool's directory ``pool_dir`` (checked by :func:`pool_directory`):
    ``<pool_dir>/segment.door``, which holds the agent's door socket and nothing else.
    ValueError if it is a symlink or not a directory; FileNotFoundError if it does not exist
    (yet: the
    agent makes it when it starts)."""
    door = pool_dir / DOOR_DIRECTORY
    if door.is_symlink():
        raise ValueError(f"the pool's door {door} is a symlink")
    if not door.exists():
        raise FileNotFoundError(f"the pool's door {door} does not exist")
    if not door.is_dir():
        raise ValueError(f"the pool's door {door} is not a directory")
    return door
