"""Gateway tokens: the tokens file with a ``gateways`` list, and a generated token."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from kvpool_agent.auth import TokenFileError
from kvpool_agent.index.auth import GatewayAuthority, Role, load_gateway_authority
from kvpool_agent.keys import tenant_id

TENANT = tenant_id("alice")


def write(path: Path, content: object) -> Path:
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def test_admin_and_gateway_tokens_may_ask_tenant_tokens_may_not(tmp_path: Path) -> None:
    tokens = {"admin": ["adm-1"], "gateways": ["gw-1", "gw-2"], "tenants": {TENANT: "ten-1"}}
    authority = GatewayAuthority.from_file(write(tmp_path / "t.yaml", tokens))
    assert authority.authenticate("adm-1") is Role.ADMIN
    assert authority.authenticate("gw-2") is Role.GATEWAY
    assert authority.authenticate("ten-1") is None
    assert authority.authenticate("gw-3") is None


def test_gateways_alone_and_as_a_single_string(tmp_path: Path) -> None:
    authority = GatewayAuthority.from_file(write(tmp_path / "t.yaml", {"gateways": "gw"}))
    assert authority.authenticate("gw") is Role.GATEWAY


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"admins": ["x"]}, "unknown keys admins"),
        ({"gateways": ["ok", 7]}, "gateways: token #2 is not a string"),
        ({"gateways": ["has space"]}, "token #1"),
        ({"gateways": {"a": "b"}}, "expected a token or a list"),
        ({"tenants": {TENANT: "t"}}, "nobody could use the index"),
        ("[1, 2", "not valid YAML or JSON"),
        ("just-a-string", "expected a mapping"),
    ],
)
def test_malformed_files_are_refused_without_showing_tokens(
    tmp_path: Path, content: object, message: str
) -> None:
    with pytest.raises(TokenFileError, match=message) as refused:
        GatewayAuthority.from_file(write(tmp_path / "t.yaml", content))
    assert "has space" not in str(refused.value)
    assert str(tmp_path) in str(refused.value)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="cannot read tokens file"):
        GatewayAuthority.from_file(tmp_path / "absent.yaml")


def test_without_a_tokens_file_a_private_token_is_generated(tmp_path: Path) -> None:
    path = tmp_path / "state" / "index-token-main"
    authority = load_gateway_authority(None, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert authority.authenticate(path.read_text().strip()) is Role.ADMIN
    configured = write(tmp_path / "t.yaml", {"gateways": ["gw"]})
    assert load_gateway_authority(configured, path).authenticate("gw") is Role.GATEWAY
