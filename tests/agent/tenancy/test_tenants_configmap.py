"""Parsing the tenants ConfigMap and granting its digests: malformed entries skipped without
their values in the log, the file's tokens kept, a digest that would mean two principals refused."""

from __future__ import annotations

import json
import logging

import pytest

from kvpool.agent.core.quota_book import QuotaBook
from kvpool.agent.tenancy.tenants_watch import grants, space_access
from kvpool.common.auth import ADMIN, Principal, TokenAuthority
from kvpool.common.keys import tenant_id
from kvpool.common.quotas import TierLimits
from kvpool.common.tenants_configmap import SpaceEntry, parse_tenants, space_key, token_digest

ALICE, BOB = tenant_id("alice"), tenant_id("bob")
WHERE = "ConfigMap ns/kvpool-main-tenants"


def _entry(*tokens: str, ceiling: object = None) -> str:
    return json.dumps(
        {"tokens": [token_digest(t) for t in tokens], "ceiling": ceiling, "tenant": "ns/a"}
    )


def test_entries_parse_and_malformed_ones_are_skipped_unquoted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = {
        ALICE: _entry("alice-token", ceiling={"l1": 4096, "nvme": None}),
        BOB: _entry("bob-token", ceiling={"l1": -1, "nvme": None}),
        "operator": json.dumps({"tokens": [token_digest("operator-token")]}),
        "secret-looking-key": _entry("x"),
        tenant_id("carol"): json.dumps({"tokens": ["not-a-digest"]}),
    }
    with caplog.at_level(logging.ERROR):
        snapshot = parse_tenants(data, WHERE)
    assert list(snapshot.tenants) == [ALICE]
    assert snapshot.tenants[ALICE].ceiling == TierLimits(4096, None)
    assert snapshot.ceilings() == {ALICE: TierLimits(4096, None)}
    assert [p for _, p in grants(snapshot)] == [ADMIN, Principal.for_tenant(ALICE)]
    assert f"entry {BOB} skipped" in caplog.text
    assert "secret-looking-key" not in caplog.text and "not-a-digest" not in caplog.text
    assert token_digest("bob-token") not in caplog.text


def test_granted_tokens_swap_whole_and_never_shadow_the_files() -> None:
    authority = TokenAuthority({"admin": "file-admin", "tenants": {BOB: "bob-token"}})
    alice = Principal.for_tenant(ALICE)
    refused = authority.replace_granted(
        [
            (bytes.fromhex(token_digest("alice-token")), alice),
            (bytes.fromhex(token_digest("bob-token")), alice),
        ]  # Bob's file token: refused
    )
    assert refused == [(bytes.fromhex(token_digest("bob-token")), alice)]
    assert authority.authenticate("alice-token") == alice
    assert authority.authenticate("bob-token") == Principal.for_tenant(BOB)
    authority.replace_granted([])
    assert authority.authenticate("alice-token") is None  # revoked
    assert authority.authenticate("file-admin") == ADMIN


def test_a_ceiling_lowers_the_default_but_not_an_own_quota() -> None:
    book = QuotaBook(default=8192, limits={BOB: 1 << 20})
    assert book.replace_ceilings({ALICE: TierLimits(4096, None), BOB: TierLimits(4096, 0)}) == {
        ALICE,
        BOB,
    }
    assert book.limits(ALICE) == TierLimits(4096, 8192)
    assert book.limits(BOB) == TierLimits.both(1 << 20)  # set by an admin: stands
    assert TierLimits(None, 10).above(TierLimits(4096, None)) == [("l1", None, 4096)]
    assert book.replace_ceilings({}) == {ALICE, BOB}
    assert book.limits(ALICE) == TierLimits.both(8192)


def test_what_a_tenant_may_set_itself_is_its_ceiling_or_else_the_default() -> None:
    book = QuotaBook(default=8192)
    book.replace_ceilings({ALICE: TierLimits(1 << 20, None)})
    assert book.own_bound(ALICE) == TierLimits(1 << 20, None)  # a ceiling above the default
    assert book.own_bound(BOB) == TierLimits.both(8192)
    assert QuotaBook().own_bound(BOB) is None  # no default, no ceiling: no bound


def test_a_space_entry_lets_its_members_act_for_it_until_it_goes() -> None:
    space = tenant_id("space")
    entry = SpaceEntry("ns/main/docs", frozenset({ALICE}), frozenset({BOB}), 1 << 20)
    snapshot = parse_tenants(
        {ALICE: _entry("alice-token"), BOB: _entry("bob-token"), space_key(space): entry.encode()},
        WHERE,
    )
    assert snapshot.spaces == {space: entry}
    authority = TokenAuthority({"admin": "admin-token"})
    authority.replace_granted(grants(snapshot))
    authority.replace_spaces(space_access(snapshot))
    alice, bob = Principal.for_tenant(ALICE), Principal.for_tenant(BOB)
    carol = Principal.for_tenant(tenant_id("carol"))
    assert authority.may_use(alice, space) and authority.may_use(bob, space)
    assert not authority.may_use(carol, space) and not authority.may_use(alice, BOB)
    assert (authority.may_pin(alice, space), authority.may_pin(bob, space)) == (False, True)
    assert authority.may_pin(ADMIN, space) and not authority.may_use(ADMIN, space)
    authority.replace_spaces(space_access(parse_tenants({}, WHERE)))
    assert not authority.may_use(alice, space) and not authority.may_pin(bob, space)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"space": "a", "members": ["nope"]}, "'members' must be a list of tenant ids"),
        ({"space": "a", "pinBudget": -1}, "'pinBudget' must be a byte count"),
        ({"space": "a", "extra": 1}, "unknown fields"),
    ],
)
def test_a_malformed_space_entry_is_skipped(
    value: object, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = space_key(tenant_id("space"))
    with caplog.at_level(logging.ERROR):
        assert parse_tenants({key: json.dumps(value)}, WHERE).spaces == {}
    assert f"entry {key} skipped: {why}" in caplog.text
