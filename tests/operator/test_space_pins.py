"""The keys the operator pins for a shared space are those a member's request stores: the
shared chunks of a structured cache_salt."""

from __future__ import annotations

from kvpool_agent.keys import ModelFingerprint, chunk_keys, shared_salt
from kvpool_operator.spaces.pins import pin_keys
from kvpool_operator.spec import FingerprintSpec

FINGERPRINT = FingerprintSpec(model="m", dtype="bfloat16", kv_layout="nhd", tp_size=2)


def test_a_pinned_prefix_has_the_keys_of_a_members_shared_chunks() -> None:
    prompt, question = list(range(100, 148)), list(range(900, 940))
    salt = shared_salt("space-salt", len(prompt), "tenant-salt")
    pinned = pin_keys(prompt, "space-salt", FINGERPRINT, chunk_tokens=16)
    assert len(pinned) == 2 * 3  # three chunks, two ranks
    for rank in range(2):
        model = ModelFingerprint("m", "bfloat16", "nhd", rank, 2, 16)
        request = [key.hex() for key in chunk_keys(prompt + question, salt, model)]
        assert pinned[3 * rank : 3 * rank + 3] == request[:3]
        other = shared_salt("space-salt", len(prompt), "another-tenant")
        assert [key.hex() for key in chunk_keys(prompt + question, other, model)][:3] == request[:3]


def test_the_fingerprints_chunk_size_wins_and_a_partial_chunk_has_no_key() -> None:
    sized = FINGERPRINT.model_copy(update={"chunk_tokens": 32, "tp_size": 1})
    assert len(pin_keys(list(range(40)), "s", sized, chunk_tokens=16)) == 1
    assert pin_keys(list(range(15)), "s", FINGERPRINT, chunk_tokens=16) == []
