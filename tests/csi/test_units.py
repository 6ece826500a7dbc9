"""The plugin's pure parts: its messages on the wire, mountinfo, and the path checks (the
target, the pool's directory, its door)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.common.names import DOOR_DIRECTORY
from kvpool.csi import messages
from kvpool.csi.mounts import parse_mountinfo
from kvpool.csi.paths import door_directory, pool_directory, target_path


def test_field_numbers_on_the_wire() -> None:
    request = messages.NodePublishVolumeRequest(volume_id="v", target_path="t", readonly=True)
    request.volume_capability.mount.fs_type = "x"
    # (number << 3 | wire type): volume_id 1, target_path 4, volume_capability 5 (mount 2,
    # fs_type 1), readonly 6
    assert request.SerializeToString() == bytes.fromhex("0a01762201742a0512030a01783001")
    info = messages.PluginInfo(type="a", name="b", endpoint="c", supported_versions=["d"])
    assert info.SerializeToString() == bytes.fromhex("0a01611201621a0163220164")
    probe = messages.ProbeResponse()
    probe.ready.value = True
    assert probe.SerializeToString() == bytes.fromhex("0a020801")


def test_mountinfo_lines() -> None:
    text = (
        "36 35 98:0 /kvpool-main /var/lib/kubelet/pods/a\\040b/mount "
        "rw,nosuid,nodev,noexec shared:1 - tmpfs shm rw,size=65536k\n"
    )
    (mount,) = parse_mountinfo(text)
    assert mount.mount_point == "/var/lib/kubelet/pods/a b/mount"
    assert mount.root == "/kvpool-main"
    assert {"nosuid", "nodev", "noexec"} <= mount.options
    assert (mount.fstype, mount.source) == ("tmpfs", "shm")


def test_target_paths(tmp_path: Path) -> None:
    pods = tmp_path / "pods"
    (pods / "uid" / "volumes").mkdir(parents=True)
    inside = pods / "uid" / "volumes" / "v" / "mount"
    assert target_path(str(inside), tmp_path) == inside
    for bad in (f"{pods}/uid/../../etc/mount", "relative/mount", f"{pods}/./x", f"{tmp_path}/x"):
        with pytest.raises(ValueError, match="target path"):
            target_path(bad, tmp_path)


def test_pool_directories(tmp_path: Path) -> None:
    (tmp_path / "kvpool-a").mkdir()
    (tmp_path / "other-app").mkdir()
    assert pool_directory(f"{tmp_path}/kvpool-a/segment", tmp_path, "a") == tmp_path / "kvpool-a"
    with pytest.raises(FileNotFoundError):
        pool_directory(f"{tmp_path}/kvpool-b/segment", tmp_path, "b")
    (tmp_path / "kvpool-link").symlink_to(tmp_path / "kvpool-a")
    for bad, pool in (
        (f"{tmp_path}/segment", "a"),
        ("/segment", "a"),
        (f"{tmp_path.parent}/segment", "a"),
        (f"{tmp_path}/kvpool-a/deeper/segment", "a"),
        (f"{tmp_path}/kvpool-link/segment", "link"),
        (f"{tmp_path}/../x/segment", "a"),
        ("kvpool-a/segment", "a"),
        # a Service annotation naming another pool's or another program's directory
        (f"{tmp_path}/kvpool-a/segment", "victim"),
        (f"{tmp_path}/other-app/segment", "other-app"),
    ):
        with pytest.raises(ValueError):
            pool_directory(bad, tmp_path, pool)


def test_doors(tmp_path: Path) -> None:
    """A pool's door is its directory's door/ itself: not yet there, a symlink (to the pool
    directory, which would publish the segment), or a file are not it."""
    pool = tmp_path / "kvpool-a"
    pool.mkdir()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        door_directory(pool)
    (pool / DOOR_DIRECTORY).symlink_to(pool)
    with pytest.raises(ValueError, match="is a symlink"):
        door_directory(pool)
    (pool / DOOR_DIRECTORY).unlink()
    (pool / DOOR_DIRECTORY).write_bytes(b"")
    with pytest.raises(ValueError, match="is not a directory"):
        door_directory(pool)
    (pool / DOOR_DIRECTORY).unlink()
    (pool / DOOR_DIRECTORY).mkdir()
    assert door_directory(pool) == pool / DOOR_DIRECTORY
