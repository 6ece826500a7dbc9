"""A ``KVPOOL_`` variable that no part of kvpool reads is refused at start, in one line with
the closest known name: a misspelled ``KVPOOL_L1SIZE=64Mi`` would otherwise leave the agent
at its default 1 GiB without a word."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvpool.agent import main as agent_main
from kvpool.common.config import AgentConfig, load_settings, unknown_variables, variables
from kvpool.common.index_config import IndexConfig
from kvpool.common.names import SHARED_VARIABLES
from kvpool.index import server as index_main
from tests.support.mistakes import BIN, clean_environment


def refused(model: type[AgentConfig] | type[IndexConfig], **environ: str) -> list[str]:
    return unknown_variables(model, environ)


def test_a_misspelled_setting_is_named_with_the_closest_one() -> None:
    assert refused(AgentConfig, KVPOOL_L1SIZE="64Mi") == [
        "KVPOOL_L1SIZE: unknown setting, no part of kvpool reads it; did you mean KVPOOL_L1_SIZE?"
    ]
    assert refused(AgentConfig, KVPOOL_NVME__PATHH="/x") == [
        "KVPOOL_NVME__PATHH: unknown setting, no part of kvpool reads it; "
        "did you mean KVPOOL_NVME__PATH?"
    ]
    assert refused(AgentConfig, kvpool_zmqport="1") == [  # any case, as pydantic reads them
        "kvpool_zmqport: unknown setting, no part of kvpool reads it; did you mean KVPOOL_ZMQ_PORT?"
    ]
    assert refused(AgentConfig, KVPOOL_XYZZYXYZZY="1") == [
        "KVPOOL_XYZZYXYZZY: unknown setting, no part of kvpool reads it; "
        "see the configuration reference"
    ]


def test_the_value_is_never_shown() -> None:
    """A misspelled token variable holds a secret: the line names the variable only."""
    (line,) = refused(AgentConfig, KVPOOL_ADMIN_TOKN="s3cret-admin-token-value")
    assert "s3cret" not in line
    assert line.endswith("did you mean KVPOOL_ADMIN_TOKEN?")


def test_every_setting_and_every_other_part_s_variable_is_known() -> None:
    environ = {name: "x" for name in variables(AgentConfig)}
    assert refused(AgentConfig, **environ) == []
    assert set(SHARED_VARIABLES) <= variables(AgentConfig)  # vLLM's, the doctor's, ...
    assert "KVPOOL_S3__BUCKET" in variables(AgentConfig)  # a nested model's field
    assert "KVPOOL_PEERS__AGENTS" in variables(AgentConfig)  # a list: JSON, no deeper
    assert not any(name.startswith("KVPOOL_PEERS__AGENTS__") for name in variables(AgentConfig))


CONNECTOR = {
    f"KVPOOL_CONNECTOR_{name}": "x"
    for name in ("ENDPOINT", "SEGMENT_PATH", "DOOR_PATH", "CHUNK_TOKENS", "TRANSPORT", "TOKEN")
} | {"KVPOOL_CONNECTOR_TOKEN_FILE": "x"}
"""The connector's variables (a vLLM's), by their names..."""
OLD_CONNECTOR = {name.replace("CONNECTOR_", ""): value for name, value in CONNECTOR.items()}
"""...and by their old names, which connectors still read (``KVPOOL_SEGMENT_PATH`` is the
agent's own setting too)."""


def test_the_connector_s_variables_are_known_by_either_name() -> None:
    """A shell (or a pod) that runs an agent and a vLLM holds both parts' variables."""
    assert refused(AgentConfig, KVPOOL_L1_SIZE="64Mi", **CONNECTOR, **OLD_CONNECTOR) == []
    assert refused(IndexConfig, **CONNECTOR, **OLD_CONNECTOR) == []
    assert refused(AgentConfig, KVPOOL_CONNECTOR_ENDPIONT="x") == [
        "KVPOOL_CONNECTOR_ENDPIONT: unknown setting, no part of kvpool reads it; "
        "did you mean KVPOOL_CONNECTOR_ENDPOINT?"
    ]


def test_the_index_checks_its_own_prefix_and_the_agent_leaves_it_alone() -> None:
    assert refused(AgentConfig, KVPOOL_INDEX_HTTP_PORTT="1") == []
    assert refused(IndexConfig, KVPOOL_L1SIZE="1", KVPOOL_INDEX_CONFIG_FILE="/x") == []
    assert refused(IndexConfig, KVPOOL_INDEX_HTTP_PORTT="1") == [
        "KVPOOL_INDEX_HTTP_PORTT: unknown setting, no part of kvpool reads it; "
        "did you mean KVPOOL_INDEX_HTTP_PORT?"
    ]


def test_kubernetes_service_links_are_not_settings() -> None:
    """A pod gets variables for each Service of its namespace: ``kvpool-main`` gives
    ``KVPOOL_MAIN_SERVICE_HOST`` and its kin in the agent's own pod."""
    links = {
        "KVPOOL_MAIN_SERVICE_HOST": "10.0.0.9",
        "KVPOOL_MAIN_SERVICE_PORT": "7400",
        "KVPOOL_MAIN_SERVICE_PORT_ZMQ": "7400",
        "KVPOOL_MAIN_PORT": "tcp://10.0.0.9:7400",
        "KVPOOL_MAIN_PORT_7400_TCP": "tcp://10.0.0.9:7400",
        "KVPOOL_MAIN_PORT_7400_TCP_PROTO": "tcp",
        "KVPOOL_MAIN_PORT_7400_TCP_PORT": "7400",
        "KVPOOL_MAIN_PORT_7400_TCP_ADDR": "10.0.0.9",
    }
    assert refused(AgentConfig, **links) == []
    # without its Service's host variable, a name ending in _PORT is a misspelling
    assert refused(AgentConfig, KVPOOL_EVENT_PORT="7402") == [
        "KVPOOL_EVENT_PORT: unknown setting, no part of kvpool reads it; "
        "did you mean KVPOOL_EVENTS_PORT?"
    ]


def test_load_settings_refuses_before_validating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_L1SIZE", "64Mi")
    monkeypatch.setenv("KVPOOL_CONNECTOR_TOKEN", "an engine's, for the vLLM of this shell")
    with pytest.raises(ValueError, match=r"^KVPOOL_L1SIZE: unknown setting") as error:
        load_settings(AgentConfig)
    assert str(error.value).count("\n") == 0


PROCESSES = {
    "kvpool-agent": (agent_main.main, {"KVPOOL_L1SIZE": "64Mi", "KVPOOL_L1_SIZE": "1"}),
    "kvpool-index": (
        index_main.main,
        {"KVPOOL_INDEX_POLL": "main", "KVPOOL_INDEX_HTTP_PORT": "-1"},
    ),
}
"""Each process's main, and its environment: a misspelled variable first, then a setting
that validation refuses (which the line must not be about: the check comes first)."""


@pytest.mark.parametrize("prog", PROCESSES)
def test_the_processes_exit_2_with_one_line(
    prog: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    main, environ = PROCESSES[prog]
    for name in [name for name in os.environ if name.startswith("KVPOOL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    misspelled = next(iter(environ))
    assert main([]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{prog}: {misspelled}: unknown setting, no part of kvpool reads it")


@pytest.mark.process
def test_kvpool_agent_refuses_a_misspelled_variable(tmp_path: Path) -> None:
    """Smoke test: the real ``kvpool-agent`` process, as the newcomer ran it."""
    env = {
        **clean_environment(tmp_path),
        **CONNECTOR,  # a vLLM's, in the same shell: not named
        **OLD_CONNECTOR,  # (its KVPOOL_SEGMENT_PATH is the agent's, below)
        "KVPOOL_L1SIZE": "64Mi",
        "KVPOOL_SEGMENT_PATH": str(tmp_path / "segment"),  # where an agent that starts
        **{f"KVPOOL_{port}_PORT": "0" for port in ("ZMQ", "HTTP", "EVENTS")},  # would go
    }
    run = subprocess.run(
        [BIN / "kvpool-agent"], check=False, env=env, capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "kvpool-agent: KVPOOL_L1SIZE: unknown setting, no part of kvpool reads it; "
        "did you mean KVPOOL_L1_SIZE?"
    ]
    assert sorted(tmp_path.iterdir()) == []  # refused before it made anything
