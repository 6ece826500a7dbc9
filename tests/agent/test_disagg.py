"""The disaggregation contracts (:mod:`kvpool.common.disagg`): kvpool's part of
``kv_transfer_params`` and the signed prefill header."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.common import disagg
from kvpool.common.disagg import DecodeParams, PrefillParams, PrefillTarget

KEY = b"k" * 16 + b"e" * 16


def test_params_round_trip() -> None:
    prefill = PrefillParams(push_to="node-b")
    assert disagg.read_params(prefill.to_json()) == prefill
    assert disagg.read_params(PrefillParams().to_json()) == PrefillParams()
    decode = DecodeParams(tokens=3000, tail=True, node="node-a", wait_ms=2000)
    assert disagg.read_params(decode.to_json()) == decode
    bare = DecodeParams(tokens=5, tail=False)
    assert disagg.read_params(bare.to_json()) == bare


def test_params_of_others_are_not_ours() -> None:
    assert disagg.read_params(None) is None
    assert disagg.read_params({"do_remote_decode": True}) is None


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ("nope", "kv_transfer_params: expected an object"),
        ({"kvpool": []}, "kv_transfer_params.kvpool: expected an object"),
        ({"kvpool": {"role": "decode"}}, "kv_transfer_params.kvpool.v: expected 1"),
        ({"kvpool": {"v": 2, "role": "decode"}}, "kv_transfer_params.kvpool.v"),
        ({"kvpool": {"v": 1, "role": "both"}}, "kv_transfer_params.kvpool.role"),
        ({"kvpool": {"v": 1, "role": "decode", "tail": True}}, ".tokens"),
        ({"kvpool": {"v": 1, "role": "decode", "tokens": 0, "tail": True}}, ".tokens"),
        ({"kvpool": {"v": 1, "role": "decode", "tokens": True, "tail": True}}, ".tokens"),
        ({"kvpool": {"v": 1, "role": "decode", "tokens": 9, "tail": 1}}, ".tail"),
        (
            {"kvpool": {"v": 1, "role": "decode", "tokens": 9, "tail": True, "wait_ms": -1}},
            ".wait_ms",
        ),
        (
            {"kvpool": {"v": 1, "role": "decode", "tokens": 9, "tail": True, "node": "a b"}},
            ".node",
        ),
        ({"kvpool": {"v": 1, "role": "prefill", "push_to": ""}}, ".push_to"),
        ({"kvpool": {"v": 1, "role": "prefill", "tokens": 9}}, "unknown field 'tokens'"),
        (
            {"kvpool": {"v": 1, "role": "decode", "tokens": 9, "tail": True, "keys": []}},
            "unknown field 'keys'",
        ),
    ],
)
def test_malformed_params_name_their_field(params: object, named: str) -> None:
    with pytest.raises(disagg.ParamsError, match=named.replace(".", r"\.")):
        disagg.read_params(params)


def test_a_signed_target_verifies() -> None:
    target = PrefillTarget("10.0.0.7:8000", "node-a", 2_000)
    value = disagg.sign_prefill(KEY, target)
    assert disagg.verify_prefill(KEY, value, now=1_999.5) == target
    v6 = PrefillTarget("[fd00::7]:8000", "", 2_000)
    assert disagg.verify_prefill(KEY, disagg.sign_prefill(KEY, v6), now=0) == v6


def test_forged_expired_or_altered_headers_are_refused() -> None:
    value = disagg.sign_prefill(KEY, PrefillTarget("10.0.0.7:8000", "node-a", 2_000))
    with pytest.raises(disagg.HeaderError, match="expired"):
        disagg.verify_prefill(KEY, value, now=2_001)
    with pytest.raises(disagg.HeaderError, match="signature"):
        disagg.verify_prefill(b"x" * 32, value, now=0)
    altered = value.replace("10.0.0.7", "169.254.169.254")
    with pytest.raises(disagg.HeaderError, match="signature"):
        disagg.verify_prefill(KEY, altered, now=0)
    later = value.replace(";2000;", ";9999;")
    with pytest.raises(disagg.HeaderError, match="signature"):
        disagg.verify_prefill(KEY, later, now=0)
    with pytest.raises(disagg.HeaderError, match="address;node;expires;signature"):
        disagg.verify_prefill(KEY, "10.0.0.7:8000", now=0)


def test_only_addresses_are_signed() -> None:
    with pytest.raises(ValueError, match="not a prefill target"):
        disagg.sign_prefill(KEY, PrefillTarget("http://evil/x;y", "n", 1))


@pytest.mark.parametrize(
    ("value", "address"),
    [
        ("10.0.0.7:8000", True),
        ("prefill-0.pods.svc:8000", True),
        ("[fd00::7]:8000", True),
        ("10.0.0.7", False),
        ("http://10.0.0.7:8000", False),
        ("10.0.0.7:8000/x", False),
        ("evil@10.0.0.7:8000", False),
    ],
)
def test_an_unsigned_address_is_held_to_the_signed_form(value: str, address: bool) -> None:
    assert disagg.is_address(value) is address


def test_a_short_key_file_is_refused_naming_it(tmp_path: Path) -> None:
    short = tmp_path / "pd.key"
    short.write_bytes(b"abc\n")
    with pytest.raises(ValueError, match=r"pd\.key: .* at least 32 bytes, has 3"):
        disagg.read_key(short)
    good = tmp_path / "good.key"
    good.write_bytes(KEY + b"\n")
    assert disagg.read_key(good) == KEY
