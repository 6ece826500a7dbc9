from __future__ import annotations

import hashlib
from array import array

from kvpool.common.keys import (
    KeyChain,
    ModelFingerprint,
    chunk_keys,
    next_key,
    root_key,
    state_key,
    tenant_id,
)

MODEL = ModelFingerprint(model="m", dtype="bfloat16", kv_layout="NHD", chunk_tokens=4)


def test_keys_cover_full_chunks_only_and_chain() -> None:
    tokens = list(range(10))
    keys = chunk_keys(tokens, "salt", MODEL)
    assert len(keys) == 2
    # the second key depends on the first: a prefix key is shared, a later one is not
    other = chunk_keys([*tokens[:4], 99, 5, 6, 7], "salt", MODEL)
    assert other[0] == keys[0] and other[1] != keys[1]


def test_the_documented_formula() -> None:
    root = hashlib.sha256(b"kvpool-root-v1\0salt\0" + MODEL.encode()).digest()
    first = hashlib.sha256(root + b"".join(t.to_bytes(4, "little") for t in range(4))).digest()
    assert root_key("salt", MODEL) == root
    assert chunk_keys(list(range(4)), "salt", MODEL) == [first]


def test_a_chunks_state_key_is_the_documented_formula_and_no_chunks_key() -> None:
    """The state that state-space layers have after chunk ``i``: its own key, from ``k_i``."""
    first, second = chunk_keys(list(range(8)), "salt", MODEL)
    assert state_key(first) == hashlib.sha256(b"kvpool-state-v1\0" + first).digest()
    assert state_key(first) not in (first, second) and state_key(first) != state_key(second)


def test_every_kind_of_token_sequence_gives_the_same_keys() -> None:
    tokens = [0, 1, 2**32 - 1, 70_000, 5, 6, 7, 8]
    expected = chunk_keys(tokens, "salt", MODEL)
    for same in (tuple(tokens), array("I", tokens), array("q", tokens)):
        assert chunk_keys(same, "salt", MODEL) == expected
    root = root_key("salt", MODEL)
    assert next_key(next_key(root, tokens[:4]), tuple(tokens[4:])) == expected[1]


def test_a_chain_grown_in_steps_hashes_each_key_once_as_the_formula_says() -> None:
    """The scheduler extends a request's chain as its tokens grow, across packing batches."""
    tokens = list(range(4 * 40 + 3))
    root = root_key("salt", MODEL)
    expected, previous = [], root
    for start in range(0, 4 * 40, 4):
        previous = next_key(previous, tokens[start : start + 4])
        expected.append(previous)
    chain = KeyChain(root, MODEL.chunk_tokens)
    grown: list[int] = []
    for asked, length in ((0, 0), (1, 3), (1, 4), (3, 9), (20, 70), (40, 90), (99, len(tokens))):
        grown.extend(tokens[len(grown) : length])
        assert chain.upto(grown, asked) == expected[: min(asked, length // 4)]
    assert chain.keys == expected and chain.parent(0) is None and chain.parent(40) == expected[39]


def test_salts_and_models_never_share_keys() -> None:
    tokens = list(range(8))
    base = chunk_keys(tokens, "a", MODEL)
    assert not set(base) & set(chunk_keys(tokens, "b", MODEL))
    assert not set(base) & set(chunk_keys(tokens, None, MODEL))
    for changed in (
        ModelFingerprint("m", "float16", "NHD", chunk_tokens=4),
        ModelFingerprint("m", "bfloat16", "HND", chunk_tokens=4),
        ModelFingerprint("m", "bfloat16", "NHD", tp_rank=1, tp_size=2, chunk_tokens=4),
        ModelFingerprint("other", "bfloat16", "NHD", chunk_tokens=4),
    ):
        assert not set(base) & set(chunk_keys(tokens, "a", changed))


def test_tenant_id_is_one_way_stable_and_never_contains_the_salt() -> None:
    salt = "my-secret-salt"
    tid = tenant_id(salt)
    assert tid == hashlib.sha256(b"kvpool-tenant-v1\0" + salt.encode()).hexdigest()[:32]
    assert len(tid) == 32 and salt not in tid
    assert tenant_id(None) == tenant_id("") != tid
