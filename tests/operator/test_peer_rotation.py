"""The keys of a pool's peer Secret, pass after pass (pure): a directory the agent's own
Keyring reads, a key added each rotation period, the previous one kept, older ones
dropped."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kvpool.common.keyring import read_keys
from kvpool.operator.peers.rotation import PeerKeyring

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
DAY = timedelta(hours=24)
KEY = "ab" * 32


def _pass(keys: PeerKeyring, at: datetime) -> PeerKeyring:
    """A pass as the operator makes it: from the Secret's values and annotation."""
    return PeerKeyring.read(keys.values(), keys.annotation(), at).rotated(at, DAY)


def _first() -> PeerKeyring:
    return PeerKeyring.read({}, None, T0).rotated(T0, DAY)


def test_a_pool_without_keys_gets_key_1_in_the_agents_format(tmp_path: Path) -> None:
    keys = _first()
    assert list(keys.values()) == ["1"]
    for name, value in keys.values().items():
        (tmp_path / name).write_text(value)
        (tmp_path / name).chmod(0o440)
    read = read_keys(tmp_path, warn=None)  # what an agent reads from the mounted Secret
    assert read.active_id == 1
    assert read.by_id[1] == keys.values()["1"].encode()
    assert len(bytes.fromhex(keys.values()["1"])) == 32
    assert json.loads(keys.annotation()) == {"1": T0.isoformat()}
    assert _first().values()["1"] != keys.values()["1"]  # random


def test_a_key_is_added_once_the_newest_is_a_rotation_old_and_the_previous_stays() -> None:
    first = _first()
    assert _pass(first, T0 + DAY - timedelta(seconds=1)) == first  # not due: nothing changes
    second = _pass(first, T0 + DAY)
    assert sorted(second.values()) == ["1", "2"]
    assert second.values()["1"] == first.values()["1"]  # a key never changes
    assert second.values()["2"] != first.values()["1"]
    assert second.created == {1: T0, 2: T0 + DAY}


def test_keys_older_than_two_rotations_go() -> None:
    second = _pass(_first(), T0 + DAY)
    third = _pass(second, T0 + 2 * DAY + timedelta(minutes=5))
    assert sorted(third.values()) == ["2", "3"]
    assert third.values()["2"] == second.values()["2"]
    assert third.created[2] == T0 + DAY


def test_after_a_long_pause_one_key_is_added_and_the_active_one_stays() -> None:
    """An operator that was down for many rotations adds one key, not one per period, and
    keeps the key every agent is using."""
    second = _pass(_first(), T0 + DAY)
    later = _pass(second, T0 + 10 * DAY)
    assert sorted(later.values()) == ["2", "3"]
    assert later.values()["2"] == second.values()["2"]
    assert _pass(later, T0 + 10 * DAY + timedelta(hours=1)) == later


@pytest.mark.parametrize(
    ("values", "kept"),
    [
        pytest.param({"1": KEY, "notes": "hi", "0": KEY, "-2": KEY}, {"1"}, id="names"),
        pytest.param({"1": KEY, "2": "short"}, {"1"}, id="short-value"),
        pytest.param({"1": KEY, "2": "AB" * 32}, {"1"}, id="upper-case"),
        pytest.param({"1": KEY, "2": "zz" * 32}, {"1"}, id="not-hex"),
    ],
)
def test_what_is_not_a_key_leaves_the_secret(values: dict[str, str], kept: set[str]) -> None:
    read = PeerKeyring.read(values, None, T0)
    assert set(read.values()) == kept
    assert read.created == {1: T0}  # no recorded time: made now


@pytest.mark.parametrize(
    "annotation",
    ["not json", "[1, 2]", '{"1": "yesterday"}', '{"one": "2026-11-25T12:00:00+00:00"}'],
)
def test_an_unreadable_annotation_counts_every_key_as_made_now(annotation: str) -> None:
    read = PeerKeyring.read({"1": KEY}, annotation, T0)
    assert read.created == {1: T0}
    assert read.rotated(T0, DAY).values() == {"1": KEY}


def test_a_time_without_a_zone_is_not_read() -> None:
    read = PeerKeyring.read({"1": KEY}, '{"1": "2026-11-20T12:00:00"}', T0)
    assert read.created == {1: T0}


def test_recorded_times_decide() -> None:
    recorded = json.dumps({"1": (T0 - DAY).isoformat()})
    rotated = PeerKeyring.read({"1": KEY}, recorded, T0).rotated(T0, DAY)
    assert sorted(rotated.values()) == ["1", "2"]
    assert rotated.values()["1"] == KEY
