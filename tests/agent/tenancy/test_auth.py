"""Bearer tokens: the file format, its errors, digests only, the generated admin token."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import stat
from pathlib import Path

import pytest

from kvpool.common import auth, files
from kvpool.common.auth import (
    ADMIN,
    ENGINE,
    GATEWAY,
    INDEX,
    FileAccess,
    Principal,
    Role,
    SpaceAccess,
    TokenAuthority,
    TokenFileError,
    load_authority,
)
from kvpool.common.files import Undo
from kvpool.common.keys import CANARY_TENANT, TENANT_ID_RULE, check_tenant_id, tenant_id
from tests.support.local_user import NOBODY, needs_root

ALICE = tenant_id("alice")
BOB = tenant_id("bob")


def strong(name: str) -> str:
    """A token a tokens file takes (32 characters or more, of many different ones), still
    readable in a failure: ``root-1-<32 hex digits>``."""
    return f"{name}-{hashlib.sha256(name.encode()).hexdigest()[:32]}"


ROOT, GATE, TEAM = strong("root"), strong("gw"), strong("alice")


def generate(files: dict[str, Path]) -> TokenAuthority:
    """Fresh tokens for ``files``, written at once."""
    authority, generated = load_authority(None, files)
    assert generated is not None
    generated.write()
    return authority


def write(tmp_path: Path, text: str, name: str = "tokens.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_with_lists(tmp_path: Path) -> None:
    root_1, root_2, alice_1, alice_2, bob_1 = map(strong, ("r1", "r2", "a1", "a2", "b1"))
    path = write(
        tmp_path,
        f"admins: [{root_1}, {root_2}]\n"
        f"tenants:\n  '{ALICE}': [{alice_1}, {alice_2}]\n  '{BOB}': [{bob_1}]\n",
    )
    authority = TokenAuthority.from_file(path)
    assert authority.token_count == 5
    assert authority.authenticate(root_1) == ADMIN
    assert authority.authenticate(root_2) == ADMIN
    assert authority.authenticate(alice_2) == Principal(Role.TENANT, ALICE)
    assert authority.authenticate(bob_1) == Principal(Role.TENANT, BOB)
    assert authority.authenticate("nobody") is None
    assert authority.authenticate("") is None


def test_json_with_single_strings(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps({"admins": ROOT, "tenants": {ALICE: TEAM}}), "tokens.json")
    authority = TokenAuthority.from_file(path)
    assert authority.authenticate(ROOT) == ADMIN
    assert authority.authenticate(TEAM) == Principal(Role.TENANT, ALICE)


def test_gateway_tokens(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"admins: {ROOT}\ngateways: [{GATE}, gw-2{GATE}]\ntenants: {{'{ALICE}': {TEAM}}}\n",
    )
    authority = TokenAuthority.from_file(path)
    assert authority.authenticate(f"gw-2{GATE}") == GATEWAY
    assert authority.authenticate(TEAM) == Principal(Role.TENANT, ALICE)
    assert TokenAuthority({"gateways": "gw"}).authenticate("gw") == GATEWAY
    assert not GATEWAY.is_admin and not GATEWAY.may_access(ALICE) and str(GATEWAY) == "gateway"


def test_tenants_only_and_admin_only_are_fine() -> None:
    assert TokenAuthority({"tenants": {ALICE: "a"}}).authenticate("a") == Principal(
        Role.TENANT, ALICE
    )
    assert TokenAuthority({"admin": "r", "tenants": None}).authenticate("r") == ADMIN


def test_only_digests_are_kept() -> None:
    secret = "very-secret-token-value"
    authority = TokenAuthority({"admin": [secret], "tenants": {ALICE: secret + "-alice"}})
    state = repr(vars(authority))
    assert secret not in state and secret.encode() not in state.encode()
    assert secret not in repr(authority)
    assert authority.authenticate(secret) == ADMIN
    assert authority.authenticate(secret + "-alice") == Principal(Role.TENANT, ALICE)


def test_principals() -> None:
    assert ADMIN.is_admin and ADMIN.may_access(ALICE) and str(ADMIN) == "admin"
    alice = Principal.for_tenant(ALICE)
    assert not alice.is_admin
    assert alice.may_access(ALICE) and not alice.may_access(BOB)
    assert str(alice) == f"tenant {ALICE}"
    with pytest.raises(ValueError, match="32 lowercase hex"):
        Principal.for_tenant("alice")


def test_a_space_of_the_file_admits_its_members_and_owners(tmp_path: Path) -> None:
    space = tenant_id("space")
    authority = TokenAuthority.from_file(
        write(
            tmp_path,
            f"admins: {ROOT}\nspaces:\n  '{space}': {{members: ['{ALICE}'], owners: ['{BOB}']}}\n",
        )
    )
    alice, bob = Principal.for_tenant(ALICE), Principal.for_tenant(BOB)
    assert authority.may_use(alice, space) and authority.may_use(bob, space)
    assert not authority.may_pin(alice, space) and authority.may_pin(bob, space)
    authority.replace_spaces({})  # the file's spaces stay
    assert authority.may_use(alice, space)


def test_who_maps_which_chunk_file() -> None:
    space, carol = tenant_id("space"), tenant_id("carol")
    authority = TokenAuthority(
        {"admin": "x", "spaces": {space: {"members": [ALICE], "owners": [BOB]}}}
    )
    alice, bob = Principal.for_tenant(ALICE), Principal.for_tenant(BOB)
    carol_ = Principal.for_tenant(carol)
    rw, ro = FileAccess.READ_WRITE, FileAccess.READ_ONLY
    expected = {
        # owner:        admin, engine, alice, bob,  carol, index, gateway
        ALICE: (rw, rw, rw, None, None, None, None),
        BOB: (rw, rw, None, rw, None, None, None),
        space: (rw, rw, ro, ro, None, None, None),
        CANARY_TENANT: (rw, rw, rw, rw, rw, None, None),
    }
    principals = (ADMIN, ENGINE, alice, bob, carol_, INDEX, GATEWAY)
    for owner, accesses in expected.items():
        found = tuple(authority.file_access(principal, owner) for principal in principals)
        assert found == accesses, owner
    assert rw == "read-write" and ro == "read-only"
    authority.replace_spaces({carol: SpaceAccess(members=frozenset({ALICE}))})
    assert authority.file_access(alice, carol) is ro  # a space granted at run time
    assert authority.file_access(carol_, carol) is rw  # its own id: the tenant's own file


@pytest.mark.parametrize(
    "value",
    ["", "alice", ALICE.upper(), ALICE[:-1], ALICE + "0", "g" * 32, f" {ALICE[1:]}"],
)
def test_malformed_tenant_ids(value: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_tenant_id(value)
    assert str(caught.value) == TENANT_ID_RULE
    assert "kvpool tenant-id" in TENANT_ID_RULE


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("- a\n- b\n", "expected a mapping"),
        (
            f"admins: {ROOT}\nusers: {{}}\n",
            "unknown key 'users'; "
            "expected 'admins', 'tenants', 'engines', 'indexes', 'gateways', 'spaces'",
        ),
        (f"admn: {ROOT}\n", "unknown key 'admn' (did you mean 'admins'?);"),
        (f"gateway: {ROOT}\n", "unknown key 'gateway' (did you mean 'gateways'?);"),
        (f"admins: {ROOT}\nusers: {{}}\nx: 1\n", "unknown keys 'users', 'x';"),
        (f"admin: {ROOT}\nadmins: {GATE}\n", "both 'admin' and 'admins' (its new name)"),
        ("gateways: {a: b}\n", "gateways: expected a token or a list of tokens, got dict"),
        (f"gateways: [{GATE}, 7]\n", "gateways: token #2 is a int, not a string"),
        (f"gateways: {GATE}\ntenants:\n  '{ALICE}': {GATE}\n", "also listed for tenant"),
        ("admins: 5\n", "admins: expected a token or a list of tokens, got int"),
        ("admins: {a: b}\n", "expected a token or a list of tokens, got dict"),
        (f"admins: [{ROOT}, 7]\n", "admins: token #2 is a int, not a string"),
        ("admins: ['']\n", "token #1 is empty"),
        ("admins: ['two words']\n", "whitespace"),
        (f"admins: {ROOT}\ntenants: [a, b]\n", "'tenants' must map tenant ids to tokens"),
        (f"tenants:\n  alice: {TEAM}\n", "tenant #1 ('alice'): tenant id must be 32"),
        (
            f"tenants:\n  12345678901234567890123456789012: {TEAM}\n",
            "is a int, not a string (quote tenant ids in YAML)",
        ),
        ("admins: []\ntenants: {}\n", "defines no tokens"),
        (f"admins: {ROOT}\ntenants:\n  '{ALICE}': {ROOT}\n", "also listed for admin"),
        ("admins: [x\n", "not valid YAML or JSON (line 2, column 1)"),
        (f"admins: {ROOT}\nspaces: [a]\n", "'spaces' must map tenant ids to members and owners"),
        (f"admins: {ROOT}\nspaces:\n  docs: {{}}\n", "space #1 ('docs'): tenant id"),
        (f"admins: {ROOT}\nspaces:\n  '{ALICE}': [a]\n", "keys 'members', 'owners'"),
        (
            f"admins: {ROOT}\nspaces:\n  '{ALICE}': {{members: [bob]}}\n",
            "'members' must be a list",
        ),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, reason: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TokenFileError) as caught:
        TokenAuthority.from_file(path)
    message = str(caught.value)
    assert reason in message
    assert str(path) in message


def test_errors_never_quote_a_token(tmp_path: Path) -> None:
    secret = strong("s3cr3t-token")
    cases = [
        f"admins: [{secret}, '{secret} with space']\n",
        f"admins: {secret}\ntenants:\n  '{ALICE}': {secret}\n",
        f"admins: [{secret}\n  tenants: {{{{\n",  # broken YAML that quotes the line
        f"{secret}: [a]\nadmins: [b]\n",  # a token pasted as a key
        f"admins: [b]\ntenants:\n  {secret}: [a]\n",  # ... or as a tenant id
        f"admins: {secret[:31]}\n",  # a token too short
    ]
    for text in cases:
        with pytest.raises(TokenFileError) as caught:
            TokenAuthority.from_file(write(tmp_path, text))
        assert secret not in str(caught.value)
        assert caught.value.__cause__ is None or secret not in str(caught.value.__cause__)


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("abc", "3 characters, 3 different"),
        ("a" * 64, "64 characters, 1 different"),
        ("ab" * 20, "40 characters, 2 different"),
        ("abcdefg" * 5, "35 characters, 7 different"),
        ("0123456789abcdefghijklmnopqrstu", "31 characters, 31 different"),
    ],
)
@pytest.mark.parametrize("key", ["admins", "engines", "indexes", "gateways", "tenant"])
def test_a_weak_token_is_refused(tmp_path: Path, token: str, why: str, key: str) -> None:
    """A brute-forcer's first guesses: short, or long of few characters."""
    text = f"tenants:\n  '{ALICE}': {token}\n" if key == "tenant" else f"{key}: [{token}]\n"
    path = write(tmp_path, text)
    with pytest.raises(TokenFileError) as caught:
        TokenAuthority.from_file(path)
    where = f"tenant {ALICE}" if key == "tenant" else key
    assert str(caught.value) == (
        f"{path}: {where}: token #1 is too easy to guess ({why}); a token needs 32 "
        "characters or more, of 8 different ones at least: make one with `openssl rand -hex 24`"
    )
    assert token not in str(caught.value).removeprefix(str(path))


def test_what_kvpool_and_its_docs_make_is_strong(tmp_path: Path) -> None:
    """The agent's and the operator's generated tokens (``token_urlsafe(32)``), the README's
    ``openssl rand -hex 24``, the e2e's ``token_urlsafe(24)``, a hex 128-bit key."""
    made = [secrets.token_urlsafe(32), secrets.token_hex(24), secrets.token_urlsafe(24)]
    made.append(secrets.token_hex(16))
    path = write(tmp_path, "admins: [" + ", ".join(made) + "]\n")
    assert TokenAuthority.from_file(path).token_count == 4


def test_the_old_admin_key_is_read_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, f"admin: {ROOT}\n")
    with caplog.at_level(logging.WARNING, logger=auth.__name__):
        authority = TokenAuthority.from_file(path)
    assert authority.authenticate(ROOT) == ADMIN
    assert [record.getMessage() for record in caplog.records] == [
        f"{path}: the key 'admin' is now 'admins'; rename it (read as 'admins')"
    ]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="cannot read tokens file"):
        TokenAuthority.from_file(tmp_path / "absent.yaml")


def test_same_token_twice_for_one_principal_is_harmless() -> None:
    authority = TokenAuthority({"admin": ["r", "r"], "tenants": {ALICE: ["a", "a"]}})
    assert authority.token_count == 2


def test_generated_admin_token(tmp_path: Path) -> None:
    path = tmp_path / "state" / "admin-token-default"
    authority = generate({"admins": path})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert len(token) >= 40  # token_urlsafe(32): 43 characters
    assert authority.authenticate(token) == ADMIN
    assert authority.token_count == 1
    assert token not in repr(vars(authority))
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left

    again = generate({"admins": path})
    fresh = path.read_text().strip()
    assert fresh != token
    assert again.authenticate(fresh) == ADMIN
    assert again.authenticate(token) is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_generated_token_replaces_a_world_readable_file(tmp_path: Path) -> None:
    path = tmp_path / "admin-token"
    path.write_text("old\n")
    path.chmod(0o644)
    generate({"admins": path})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "planted", ["link", pytest.param("another user's file", marks=[pytest.mark.root, needs_root])]
)
def test_the_generated_token_never_goes_where_another_user_points(
    tmp_path: Path, planted: str
) -> None:
    """A link (or a file of another user) at the token's name: refused, in one line naming
    the owner and mode, and nothing written through it."""
    target = tmp_path / "root-secret"
    target.write_text("root's own\n")
    target.chmod(0o600)
    path = tmp_path / "admin-token-default"
    if planted == "link":
        path.symlink_to(target)
    else:
        path.write_text("theirs\n")
        os.chown(path, NOBODY, NOBODY)
    before = os.lstat(path)
    with pytest.raises(OSError) as refused:
        generate({"admins": path})
    message = str(refused.value)
    assert message.startswith(f"refusing token file {path}:") and "\n" not in message
    assert f"owner uid {before.st_uid}, mode {stat.S_IMODE(before.st_mode):04o}" in message
    assert target.read_text() == "root's own\n"
    assert os.lstat(path).st_ino == before.st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin-token-default", "root-secret"]


def test_load_authority(tmp_path: Path) -> None:
    tokens = write(tmp_path, f"admins: {ROOT}\n")
    path = tmp_path / "state" / "admin-token-pool"
    authority, generated = load_authority(tokens, {"admins": path})
    assert authority.authenticate(ROOT) == ADMIN
    assert generated is None
    authority, generated = load_authority(None, {"admins": path})
    assert generated is not None
    assert not path.parent.exists()  # nothing written before the caller has started
    generated.write()
    assert authority.authenticate(path.read_text().strip()) == ADMIN


def test_a_token_file_not_written_is_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second file fails once the first is written: an undo told of each file removes
    the first, and the directories noted before, not what was there."""
    state = tmp_path / "state" / "deeper"
    first, second = state / "admin-token", tmp_path / "engine-token"
    _, generated = load_authority(None, {"admins": first, "engines": second})
    assert generated is not None

    def write_file(path: Path, data: bytes, mode: int, *, what: str) -> bool:
        if path == second:
            raise OSError(28, "No space left on device")
        return files.write_file(path, data, mode, what=what)

    monkeypatch.setattr(auth, "write_file", write_file)
    undo = Undo()
    undo.directories(state)
    with pytest.raises(OSError, match="No space left"):
        generated.write(undo.file)
    undo.run()
    assert list(tmp_path.iterdir()) == []
