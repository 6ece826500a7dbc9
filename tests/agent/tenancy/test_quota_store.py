"""The file quota store: round trip, restarts, atomic replacement, corruption; loading at start."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kvpool.agent.tenancy.quota_store import FileQuotaStore, QuotaStoreError
from kvpool.common.keys import tenant_id
from kvpool.common.quotas import TierLimits
from tests.support.chunks import key
from tests.support.l1 import PAGE, make_cache, make_service
from tests.support.local_user import NOBODY, needs_root

ALICE = tenant_id("alice")
BOB = tenant_id("bob")


def write_private(path: Path, text: str) -> None:
    """A quota file as the agent writes it: its own, mode 0600."""
    path.write_text(text)
    path.chmod(0o600)


def test_round_trip(tmp_path: Path) -> None:
    store = FileQuotaStore(tmp_path / "q.json")
    assert store.load() == {}
    store.save(ALICE, 1 << 20)
    store.save(BOB, None)
    store.save(ALICE, 0)
    assert store.load() == {ALICE: 0, BOB: None}
    store.delete(BOB)
    store.delete(BOB)  # deleting twice is a no-op
    assert store.load() == {ALICE: 0}
    assert json.loads((tmp_path / "q.json").read_text()) == {ALICE: 0}


def test_limits_per_tier_round_trip_and_older_files_still_load(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    write_private(path, json.dumps({ALICE: 4096, BOB: None}))  # before tiers had limits
    store = FileQuotaStore(path)
    assert store.load() == {ALICE: 4096, BOB: None}
    store.save(BOB, TierLimits(l1=1024, nvme=None))
    store.save(ALICE, TierLimits(l1=2048, nvme=2048))
    assert store.load() == {ALICE: 2048, BOB: TierLimits(1024, None)}
    # tiers that agree keep the older single form, readable by an older agent
    assert json.loads(path.read_text()) == {ALICE: 2048, BOB: {"l1": 1024, "nvme": None}}


def test_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state" / "quotas.json"  # the directory is created on first write
    FileQuotaStore(path).save(ALICE, 4096)
    FileQuotaStore(path).save(BOB, None)
    assert FileQuotaStore(path).load() == {ALICE: 4096, BOB: None}


def test_replaces_atomically_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    store = FileQuotaStore(path)
    store.save(ALICE, 1)
    with path.open() as reader:  # a reader that opened the old version keeps it whole
        store.save(ALICE, 2)
        assert json.loads(reader.read()) == {ALICE: 1}
    for limit in range(3, 20):
        store.save(ALICE, limit)
    assert store.load() == {ALICE: 19}
    assert [entry.name for entry in tmp_path.iterdir()] == ["q.json"]


def test_delete_of_an_absent_tenant_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    FileQuotaStore(path).delete(ALICE)
    assert not path.exists()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        json.dumps({ALICE: -1}),
        json.dumps({ALICE: "1GiB"}),
        "1.5",
        json.dumps({ALICE: {"l1": 1}}),
        json.dumps({ALICE: {"l1": 1, "nvme": -2}}),
        json.dumps({ALICE: {"l1": 1, "nvme": True}}),
    ],
)
def test_corrupt_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "q.json"
    write_private(path, content)
    store = FileQuotaStore(path)
    with pytest.raises(QuotaStoreError, match=str(path)):
        store.load()
    with pytest.raises(QuotaStoreError):
        store.save(ALICE, 1)  # a change never overwrites a file it cannot read
    assert path.read_text() == content


def test_unwritable_location(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    store = FileQuotaStore(blocker / "q.json")
    with pytest.raises(QuotaStoreError, match="cannot"):
        store.save(ALICE, 1)


@pytest.mark.parametrize(
    "planted",
    [
        "a file others may write",
        "a link to root's file",
        pytest.param("another user's file", marks=[pytest.mark.root, needs_root]),
    ],
)
def test_a_quota_file_that_is_not_the_agents_own_is_refused(tmp_path: Path, planted: str) -> None:
    """Applied, another user's quotas would be theirs to choose; written through a link, the
    agent would overwrite the file it points at."""
    secret = tmp_path / "root-secret"
    write_private(secret, json.dumps({ALICE: 1}))
    path = tmp_path / "q.json"
    if planted == "a link to root's file":
        path.symlink_to(secret)
    else:
        write_private(path, json.dumps({ALICE: 1}))
        if planted == "a file others may write":
            path.chmod(0o666)
        else:
            os.chown(path, NOBODY, NOBODY)
    status = os.lstat(path)
    store = FileQuotaStore(path)
    for change in (store.load, lambda: store.save(BOB, 1)):
        with pytest.raises(QuotaStoreError) as refused:
            change()
        message = str(refused.value)
        assert message.startswith(f"refusing quota file {path}:") and "\n" not in message
        assert f"owner uid {status.st_uid}, mode {stat.S_IMODE(status.st_mode):04o}" in message
    assert json.loads(secret.read_text()) == {ALICE: 1}
    assert os.lstat(path).st_ino == status.st_ino


def test_the_quota_file_is_the_agents_alone_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "state" / "q.json"
    previous = os.umask(0)
    try:
        FileQuotaStore(path).save(ALICE, 1)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_load_quotas_applies_stored_limits(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    store = FileQuotaStore(path)
    store.save(ALICE, 2 * PAGE)
    store.save(BOB, None)

    cache = make_cache()
    lease = cache.reserve(ALICE, [key(i) for i in range(5)], [PAGE] * 5).lease
    assert lease is not None
    cache.commit(lease)
    service = make_service(cache, path)  # a restarted agent
    assert service.load_quotas() == 2
    alice = service.quota(ALICE)
    assert (alice.limit, alice.explicit) == (2 * PAGE, True)
    assert service.usage(ALICE).used_bytes <= 2 * PAGE  # applying a smaller limit evicts
    bob = service.quota(BOB)
    assert (bob.limit, bob.explicit) == (None, True)
    assert not service.quota(tenant_id("carol")).explicit


def test_service_writes_through_before_applying(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    service = make_service(make_cache(), path)
    service.set_quota(ALICE, 3 * PAGE)
    assert FileQuotaStore(path).load() == {ALICE: 3 * PAGE}
    service.delete_quota(ALICE)
    assert FileQuotaStore(path).load() == {}
    assert not service.quota(ALICE).explicit


def test_failed_store_leaves_the_quota_unchanged(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    service = make_service(make_cache(), blocker / "q.json", tmp_path / "chunk-files")
    with pytest.raises(QuotaStoreError):
        service.set_quota(ALICE, 0)
    assert not service.quota(ALICE).explicit
    assert service.quota(ALICE).limit is None


def test_replace_quotas_applies_a_store_change_exactly(tmp_path: Path) -> None:
    cache = make_cache(pages=100)
    service = make_service(cache, tmp_path / "q.json")
    for n in range(10):
        reservation = cache.reserve("a", [key(n)], [PAGE])
        assert reservation.lease is not None
        cache.commit(reservation.lease)
    service.set_quota("b", 5 * PAGE)
    service.replace_quotas({"a": 2 * PAGE, "c": None})  # another agent's view of the store
    assert service.quota("a").limit == 2 * PAGE and service.quota("a").explicit
    assert not service.quota("b").explicit  # gone from the store: back to the default
    assert service.quota("c").explicit and service.quota("c").limit is None
    assert cache.tenant_usage("a").used_bytes == 2 * PAGE  # the shrink evicted at once
