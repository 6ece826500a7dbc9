"""The connector's token: found where a pod or a user puts it; missing or refused, one warning
and the cache off, never a crash (against a real agent)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvpool.common.keys import tenant_id
from kvpool.connector.counters import Counters
from kvpool.connector.discovery import AgentAddress
from kvpool.connector.identity import CredentialMissing, credential
from kvpool.connector.link import AgentLink, LinkDown
from kvpool.connector.settings import ConnectorSettings
from tests.support.agent_process import ENGINE_TOKEN, AgentProcess
from tests.support.chunks import key

pytestmark = pytest.mark.process

SETTINGS = ConnectorSettings.load({"endpoint": "tcp://127.0.0.1:7400"}, environ={})


def _file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_token_is_found_in_order(tmp_path: Path) -> None:
    state = tmp_path / "state"  # an embedded default agent's, on this machine
    state.mkdir()
    _file(state, "engine-token-main", "from-the-embedded-default\n")
    mounted = _file(tmp_path, "mounted", "from-a-secret\n")
    configured = ConnectorSettings.load({"pool": "main", "token_file": str(mounted)}, {})
    env_file = str(_file(tmp_path, "env", "from-the-env-file\n"))
    pool = ConnectorSettings.load({"pool": "main"}, environ={})

    def found(settings: ConnectorSettings, environ: dict[str, str]) -> str:
        return credential(settings, environ, state)()

    assert found(configured, {"KVPOOL_CONNECTOR_TOKEN": "from-env"}) == "from-env"
    assert found(configured, {"KVPOOL_CONNECTOR_TOKEN_FILE": env_file}) == "from-the-env-file"
    assert found(configured, {}) == "from-a-secret"
    assert found(pool, {}) == "from-the-embedded-default"
    with pytest.raises(CredentialMissing) as nowhere:
        credential(pool, {}, tmp_path / "no-agent-here")()
    assert "no token for the kvpool agent: set KVPOOL_CONNECTOR_TOKEN" in str(nowhere.value)


def test_a_missing_or_unreadable_token_says_where_to_put_one(tmp_path: Path) -> None:
    with pytest.raises(CredentialMissing) as missing:
        credential(SETTINGS, {"KVPOOL_CONNECTOR_TOKEN_FILE": str(tmp_path / "absent")})()
    assert str(missing.value).startswith(f"cannot read the token file {tmp_path / 'absent'}")
    two_lines = _file(tmp_path, "bad", "one\ntwo\n")
    with pytest.raises(CredentialMissing) as bad:
        credential(SETTINGS, {"KVPOOL_CONNECTOR_TOKEN_FILE": str(two_lines)})()
    assert str(bad.value) == f"{two_lines}: expected one token on one line"


def _link(agent: AgentProcess, token: str | None) -> AgentLink:
    def source() -> str:
        if token is None:
            raise CredentialMissing("no token for the kvpool agent: set KVPOOL_CONNECTOR_TOKEN")
        return token

    return AgentLink(
        lambda: AgentAddress(agent.zmq, None, None),
        credential=source,
        role="scheduler",
        timeout=2.0,
        retry_min_s=60.0,
        retry_max_s=60.0,
        counters=Counters(),
    )


@pytest.mark.parametrize(
    ("token", "said"),
    [(None, "no token for the kvpool agent"), ("not-this-pools", "refused the connector's")],
)
def test_a_missing_or_refused_token_is_one_warning_and_no_cache(
    agent_process: AgentProcess,
    caplog: pytest.LogCaptureFixture,
    token: str | None,
    said: str,
) -> None:
    agent = agent_process.start()
    link = _link(agent, token)
    with caplog.at_level(logging.WARNING, logger="kvpool.connector.link"):
        for _ in range(3):  # vLLM goes on: every call says "no cache", none raises else
            with pytest.raises(LinkDown):
                link.lookup(tenant_id(None), [key(1)], lock=False, count=True)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and said in warnings[0], warnings
    assert link.is_down


def test_an_engines_token_works_and_a_teams_binds_its_unsalted_requests(
    agent_process: AgentProcess,
) -> None:
    alice = tenant_id("alice")
    agent_process.tenant_tokens = {alice: "alice-token-4c8e1f7a93b05d26e7a1"}
    agent = agent_process.start()
    engine, team = _link(agent, ENGINE_TOKEN), _link(agent, "alice-token-4c8e1f7a93b05d26e7a1")
    assert engine.lookup(tenant_id(None), [key(1)], lock=False, count=True).count == 0
    assert engine.bound_tenant == ""
    team.lookup(tenant_id(None), [key(1)], lock=False, count=True)
    assert team.bound_tenant == alice
