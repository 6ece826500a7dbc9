"""The keys the operator pins for a shared space are those a member's request stores: the
shared chunks of a structured cache_salt."""

from __future__ import annotations

from kvpool.common.keys import ModelFingerprint, chunk_keys, shared_salt
from kvpool.operator.spaces.pins import pin_keys, rank_chains
from kvpool.operator.spec import FingerprintSpec

FINGERPRINT = FingerprintSpec(model="m", dtype="bfloat16", kv_layout="nhd", tp_size=2)


def test_a_pinned_prefix_has_the_keys_of_a_members_shared_chunks() -> None:
    prompt, question = list(range(100, 148)), list(range(900, 940))
    salt = shared_salt("space-salt", len(prompt), "tenant-salt")
    chains = rank_chains(prompt, "space-salt", FINGERPRINT, chunk_tokens=16)
    assert [len(chain) for chain in chains] == [3, 3]  # three chunks, two ranks
    for rank in range(2):
        model = ModelFingerprint("m", "bfloat16", "nhd", rank, 2, 16)
        request = [key.hex() for key in chunk_keys(prompt + question, salt, model)]
        assert chains[rank] == request[:3]
        other = shared_salt("space-salt", len(prompt), "another-tenant")
        assert [key.hex() for key in chunk_keys(prompt + question, other, model)][:3] == request[:3]


def test_a_pin_holds_every_ranks_head_first() -> None:
    """An agent whose pin budget holds only part of a pin keeps its first keys: the same
    chunks of every rank."""
    (first, second) = rank_chains(list(range(48)), "s", FINGERPRINT, chunk_tokens=16)
    assert pin_keys([first, second]) == [
        first[0],
        second[0],
        first[1],
        second[1],
        first[2],
        second[2],
    ]


def test_the_fingerprints_chunk_size_wins_and_a_partial_chunk_has_no_key() -> None:
    sized = FINGERPRINT.model_copy(update={"chunk_tokens": 32, "tp_size": 1})
    assert [len(chain) for chain in rank_chains(list(range(40)), "s", sized, 16)] == [1]
    assert rank_chains(list(range(15)), "s", FINGERPRINT, chunk_tokens=16) == [[], []]
