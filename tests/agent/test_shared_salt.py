"""Structured cache_salt: what is shared, what never is, and what a malformed one means."""

from __future__ import annotations

import time

import pytest

from kvpool.common import keys

CHUNK = 4
FINGERPRINT = keys.ModelFingerprint("m", "bfloat16", "layout", chunk_tokens=CHUNK)
PROMPT = list(range(100, 124))  # six chunks


def keys_of(salt: str | None, tokens: list[int] = PROMPT) -> list[bytes]:
    return keys.chunk_keys(tokens, salt, FINGERPRINT)


def test_a_structured_salt_round_trips_any_characters() -> None:
    salt = keys.shared_salt("sp;a=ce %/é", 9, "te;n=ant")
    assert salt.startswith("kvpool-share-v1;space=")
    plan = keys.plan_salt(salt)
    assert plan == keys.SaltPlan("te;n=ant", "sp;a=ce %/é", 9)
    assert plan.shared_chunks(CHUNK) == 2  # 9 tokens: the boundary rounds down


def test_tenants_of_one_space_share_the_shared_chunks_and_nothing_else() -> None:
    a = keys_of(keys.shared_salt("space", 12, "alice"))
    b = keys_of(keys.shared_salt("space", 12, "bob"))
    assert a[:3] == b[:3]
    assert all(x != y for x, y in zip(a[3:], b[3:], strict=True))
    # the shared chunks are the space's own keys: a plain request under the space's salt
    assert a[:3] == keys_of("space")[:3]


def test_a_private_chunk_never_matches_another_tenants_even_with_its_own_salt() -> None:
    shared = keys_of(keys.shared_salt("space", 12, "alice"))
    assert not set(shared[3:]) & set(keys_of("alice"))
    assert not set(shared[3:]) & set(keys_of("space"))
    assert not set(shared[3:]) & set(keys_of(keys.shared_salt("space", 12, "mallory")))


def test_a_guessed_space_salt_shares_nothing() -> None:
    alice = keys_of(keys.shared_salt("space-salt", 12, "alice"))
    guess = keys_of(keys.shared_salt("space", 12, "alice"))
    assert not set(alice) & set(guess)


def test_nothing_shared_is_the_plain_tenant_salt() -> None:
    assert keys_of(keys.shared_salt("space", 3, "alice")) == keys_of("alice")
    assert keys_of(keys.shared_salt("space", 0, "")) == keys_of(None)


def test_the_boundary_moves_the_mix() -> None:
    two = keys_of(keys.shared_salt("space", 8, "alice"))
    three = keys_of(keys.shared_salt("space", 12, "alice"))
    assert two[:2] == three[:2] and two[2] != three[2]


def test_the_first_private_chunk_has_no_parent_in_the_space() -> None:
    plan = keys.plan_salt(keys.shared_salt("space", 8, "alice"))
    chain = plan.chain(CHUNK, lambda salt: keys.root_key(salt, FINGERPRINT))
    chain.upto(PROMPT, 6)
    assert chain.parent(1) == chain.keys[0]
    assert chain.parent(2) is None
    assert chain.parent(3) == chain.keys[2]


@pytest.mark.parametrize(
    ("salt", "tenant", "problem"),
    [
        ("kvpool-share-v2;space=a;shared=4;tenant=t", "t", "unknown version"),
        ("kvpool-share-v1;space=a;shared=four;tenant=t", "t", "decimal"),
        ("kvpool-share-v1;space=a;shared=-4;tenant=t", "t", "decimal"),
        ("kvpool-share-v1;space=a;shared=4;tenant=t;x=1", "t", "unknown field"),
        ("kvpool-share-v1;space=a;space=b;shared=4;tenant=t", "t", "twice"),
        ("kvpool-share-v1;space=a;b;shared=4;tenant=t", "t", "unknown field"),
        ("kvpool-share-v1;space=a;tenant=t", "t", "missing fields ['shared']"),
        ("kvpool-share-v1;space=a%zz;shared=4;tenant=t", "t", "percent-encoded"),
        ("kvpool-share-v1;space=a=b;shared=4;tenant=t", "t", "percent-encoded"),
        ("kvpool-share-v1;space=%FF;shared=4;tenant=t", "t", "UTF-8"),
        ("kvpool-share-v1;space=;shared=4;tenant=t", "t", "empty"),
    ],
)
def test_a_malformed_structured_salt_is_the_tenants_alone(
    salt: str, tenant: str, problem: str
) -> None:
    plan = keys.plan_salt(salt)
    assert plan.problem is not None and problem in plan.problem
    assert (plan.tenant_salt, plan.space_salt, plan.cacheable) == (tenant, None, True)
    assert keys_of(salt) == keys_of(tenant)  # never the whole string as a plain salt


@pytest.mark.parametrize(
    "salt",
    [
        "kvpool-share-v1;space=a;shared=4",
        "kvpool-share-v1;space=a;shared=4;tenant=%zz",
        "kvpool-share-",
        "kvpool-share-v1",
    ],
)
def test_a_structured_salt_without_a_tenant_gets_no_cache(salt: str) -> None:
    plan = keys.plan_salt(salt)
    assert not plan.cacheable and plan.problem
    assert keys_of(salt) == []


def test_plain_salts_are_untouched() -> None:
    for salt in (None, "", "alice", "kvpool-shared", "share-v1;space=a"):
        assert keys.plan_salt(salt) == keys.SaltPlan(salt)


def test_a_space_needs_a_salt_and_a_count() -> None:
    with pytest.raises(ValueError, match="empty"):
        keys.shared_salt("", 4, "t")
    with pytest.raises(ValueError, match="0 or more"):
        keys.shared_salt("s", -1, "t")


@pytest.mark.parametrize("structured", [True, False])
def test_a_salt_past_the_cap_gets_no_cache_at_once(structured: bool) -> None:
    """An 8 MiB salt once took seconds to parse, in the scheduler every tenant waits on."""
    huge = "a" * (8 << 20)
    salt = keys.shared_salt(huge, 512, "alice") if structured else huge
    seconds = []
    for _ in range(3):  # the best of three: a busy machine may pause any one call
        started = time.perf_counter()
        plan = keys.plan_salt(salt)
        seconds.append(time.perf_counter() - started)
    assert min(seconds) < 0.010
    assert plan == keys.SaltPlan(None, problem=keys.SALT_TOO_LONG, cacheable=False)
    assert "cache_salt longer than 4096 characters" in keys.SALT_TOO_LONG
    assert keys_of(salt) == []


def test_salts_up_to_the_cap_parse() -> None:
    space, tenant = "é;%" * 128, "%é;" * 128  # 512 bytes each, every one escaped
    salt = keys.shared_salt(space, 8, tenant)
    assert len(salt) <= keys.MAX_SALT_CHARS
    assert keys.plan_salt(salt) == keys.SaltPlan(tenant, space, 8)
    at_cap = "s" * keys.MAX_SALT_CHARS
    assert keys.plan_salt(at_cap) == keys.SaltPlan(at_cap)
