"""The master keys' directory: generation, validation, a Secret mount and its updates."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvpool_agent.l2.keyring import Keyring, KeyringError, generate_key, read_keys

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
