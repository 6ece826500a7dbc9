"""The master keys' directory: generation, validation, a Secret mount and its updates."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from kvpool.common.keyring import Keyring, KeyringError, generate_key, read_keys
from tests.support.local_user import NOBODY, needs_root

from .conftest import write_key

KEY_1, KEY_2 = b"1" * 64, b"2" * 64


def test_a_generated_key_is_private_and_kept(tmp_path: Path) -> None:
    keys = tmp_path / "state" / "l2-keys"
    generate_key(keys)
    path = keys / "1"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    material = path.read_bytes()
    generate_key(keys)  # a restart keeps it
    assert read_keys(keys).by_id == {1: material}


def test_unusable_key_directories_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(KeyringError, match="holds no key"):
        read_keys(tmp_path)
    write_key(tmp_path / "short", 1, b"too short")
    with pytest.raises(KeyringError, match="at least 32"):
        read_keys(tmp_path / "short")
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(KeyringError, match="cannot be made"):  # as it would in a read-only mount
        generate_key(tmp_path / "a-file" / "keys")


def test_a_secret_mount_is_read_and_a_broken_update_keeps_the_keys(tmp_path: Path) -> None:
    """A Secret volume: entries are links into a timestamped directory, beside ``..data``."""
    mount = tmp_path / "mount"
    write_key(mount / "..2026_11_25", 3, KEY_1)
    (mount / "..data").symlink_to("..2026_11_25")
    (mount / "3").symlink_to("..data/3")
    keyring = Keyring(mount, reload_seconds=0)
    assert keyring.current().by_id == {3: KEY_1}
    (mount / "4").write_bytes(b"short")  # a bad update: the keys in use stay
    assert keyring.current().by_id == {3: KEY_1}
    (mount / "4").write_bytes(KEY_2)
    assert keyring.current().by_id == {3: KEY_1, 4: KEY_2}
    assert keyring.current().active_id == 4


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_key_file_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    """Whoever may write the key may choose it, and then read every object sealed under it."""
    write_key(tmp_path, 1, KEY_1)
    path = tmp_path / "1"
    path.chmod(mode)
    with pytest.raises(KeyringError) as refused:
        read_keys(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"refusing L2 key file {path}:") and "\n" not in message
    assert f"(owner uid {os.geteuid()}, mode {mode:04o})" in message
    assert "chmod go-w" in message


@pytest.mark.root
@needs_root
def test_a_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    write_key(tmp_path, 1, KEY_1)
    os.chown(tmp_path / "1", NOBODY, NOBODY)
    with pytest.raises(KeyringError, match=f"belongs to another user \\(owner uid {NOBODY}"):
        Keyring(tmp_path)


def test_a_key_file_every_user_may_read_is_used_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_key(tmp_path, 1, KEY_1)
    path = tmp_path / "1"
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kvpool.common.keyring"):
        keyring = Keyring(tmp_path, reload_seconds=0)
        assert keyring.current().by_id == {1: KEY_1}  # reread: warned once
    (warning,) = [record.getMessage() for record in caplog.records]
    assert warning.startswith(f"L2 key file {path} is readable by every user")
    assert "mode 0644" in warning
    caplog.clear()
    path.chmod(0o440)  # a Secret's defaultMode: the pod's group only
    with caplog.at_level(logging.WARNING, logger="kvpool.common.keyring"):
        assert Keyring(tmp_path).current().by_id == {1: KEY_1}
    assert caplog.records == []


def test_a_generated_key_is_private_whatever_the_umask(tmp_path: Path) -> None:
    keys = tmp_path / "nvme" / ".kvpool-keys" / "pool"
    previous = os.umask(0)
    try:
        generate_key(keys)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((keys / "1").stat().st_mode) == 0o600
    for directory in (keys, keys.parent):  # both made by the agent: nobody else lists them
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert [entry.name for entry in keys.iterdir()] == ["1"]  # no temporary left
