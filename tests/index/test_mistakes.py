"""``kvpool-index`` given broken inputs: one line per problem, naming the file, the flag,
setting or variable as written and the value; exit 2. The table runs through ``main(argv)``;
a row of it, a port held and a second index run ``kvpool-index`` as a process."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpool.tools.cli import main
from tests.support.index_process import IndexProcess
from tests.support.mistakes import BIN, Mistake, feed, held_port, refuse

AGENT = ["--agent", "gpu-1=tcp://127.0.0.1:1,tcp://127.0.0.1:2"]
FILE = ["--config", "{tmp}/index.yaml"]

INDEX = [
    Mistake(
        "no-agents",
        [],
        [
            "kvpool-index: agents (not set): static discovery needs agents: --agent "
            "NODE=ZMQ,EVENTS, agents in the configuration file, or discovery kubernetes"
        ],
    ),
    Mistake(
        "agent-flag",
        ["--agent", "nonsense"],
        ["kvpool-index: --agent nonsense: expected NODE=ZMQ_ENDPOINT,EVENTS_ENDPOINT"],
    ),
    Mistake(
        "agent-twice",
        [*AGENT, "--agent", "gpu-1=tcp://127.0.0.1:3,tcp://127.0.0.1:4"],
        [
            "kvpool-index: --agent gpu-1=tcp://127.0.0.1:3,tcp://127.0.0.1:4: each node may be "
            "listed once: gpu-1 more than once"
        ],
    ),
    Mistake(
        "yaml-syntax",
        FILE,
        ["kvpool-index: {tmp}/index.yaml: not YAML or JSON: line 2, column 1: "],
        files={"index.yaml": "agents: [gpu-1: {\n"},
    ),
    Mistake(
        "file-agent-incomplete",
        FILE,
        ["kvpool-index: {tmp}/index.yaml: agents[0].events: required, not set"],
        files={"index.yaml": "agents:\n  - node: gpu-1\n    zmq: tcp://127.0.0.1:1\n"},
    ),
    Mistake(
        "file-unknown-key",
        FILE,
        ["kvpool-index: {tmp}/index.yaml: agentz=[]: unknown setting; did you mean agents?"],
        files={"index.yaml": "agentz: []\ndiscovery: kubernetes\n"},
    ),
    Mistake(
        "env-not-json",
        [],
        ["kvpool-index: KVPOOL_INDEX_AGENTS=[bad: not valid JSON"],
        env={"KVPOOL_INDEX_AGENTS": "[bad"},
    ),
    Mistake(
        "env-choice",
        [],
        ["kvpool-index: KVPOOL_INDEX_DISCOVERY=dns: input should be 'static' or 'kubernetes'"],
        env={"KVPOOL_INDEX_DISCOVERY": "dns"},
    ),
    Mistake(
        "env-ambiguous-size",
        AGENT,
        [
            "kvpool-index: KVPOOL_INDEX_HTTP_LIMITS__MAX_BODY_BYTES=16MB: ambiguous unit MB: "
            "write 16M (M: 10^6) or 16Mi (Mi: 2^20)"
        ],
        env={"KVPOOL_INDEX_HTTP_LIMITS__MAX_BODY_BYTES": "16MB"},
    ),
    Mistake(
        "unknown-flag",
        ["--agents", "x"],
        ["kvpool-index: unrecognized arguments: --agents x"],
    ),
]


def index(argv: Sequence[str]) -> object:
    return main(["index", *argv])


@pytest.mark.parametrize("mistake", INDEX, ids=str)
def test_index(mistake: Mistake, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refuse(index, mistake, tmp_path, capsys)


@pytest.mark.process
def test_the_script_refuses_in_one_line(tmp_path: Path) -> None:
    feed(f"{BIN}/kvpool-index", INDEX[0], tmp_path)


def port_in_use(state_dir: str) -> Mistake:
    """The HTTP port held by another socket, the index's state in ``state_dir``."""
    return Mistake(
        "http-port",
        [*AGENT, "--log-level", "warning"],
        ["kvpool-index: port {port} (http_port) is in use on 127.0.0.1"],
        env={
            "KVPOOL_INDEX_HTTP_PORT": "{port}",
            "KVPOOL_INDEX_AGENT_TOKEN_FILE": "{tmp}/index-token",
            "KVPOOL_INDEX_STATE_DIR": state_dir,
        },
        files={"index-token": "index-token-of-the-pool\n"},
    )


@pytest.mark.process
def test_index_port_in_use(tmp_path: Path) -> None:
    """Refused before anything is written: no state directory, no generated token."""
    with held_port() as port:
        feed(f"{BIN}/kvpool-index", port_in_use("{tmp}/state/index"), tmp_path, port=port)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["index-token"]


@pytest.mark.process
def test_a_second_index_leaves_the_first_ones_token(tmp_path: Path) -> None:
    """A second index on a running one's port and state directory: refused in one line;
    the first one's generated admin token stays, and still works."""
    agents = {"gpu-1": SimpleNamespace(zmq="tcp://127.0.0.1:1", events="tcp://127.0.0.1:2")}
    first = IndexProcess(tmp_path / "first", agents, tokens_file=False)
    try:
        token_file = tmp_path / "first" / "state" / "index-admin-token-default"
        before = token_file.stat()
        token = token_file.read_text()
        port = urllib.parse.urlsplit(first.url).port
        assert port is not None
        feed(f"{BIN}/kvpool-index", port_in_use(str(token_file.parent)), tmp_path, port=port)
        after = token_file.stat()
        assert token_file.read_text() == token
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        assert os.listdir(token_file.parent) == [token_file.name]
        assert first.get("/v1/nodes", token.strip())
    finally:
        first.stop()
