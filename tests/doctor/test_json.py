"""``kvpool doctor --json``: the checks as one JSON object on standard output, the lines
people read on standard error as the checks run."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from tests.doctor.conftest import clean_env, run_doctor
from tests.support.agent_process import ENGINE_TOKEN
from tests.support.mistakes import BIN


@pytest.mark.process
def test_json_holds_every_check_and_the_lines_go_to_stderr() -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
    args = ("--endpoint", endpoint, "--timeout", "0.5")
    text = run_doctor(*args)
    as_json = subprocess.run(
        [BIN / "kvpool", "doctor", *args, "--json"],
        env={**clean_env(), "KVPOOL_CONNECTOR_TOKEN": ENGINE_TOKEN},  # as run_doctor's
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert as_json.returncode == text.returncode == 1  # the agent is unreachable
    result = json.loads(as_json.stdout)
    assert result["failed"] is True
    checks = result["checks"]
    assert [set(check) for check in checks] == [{"name", "outcome", "seen", "fix"}] * len(checks)
    assert {check["outcome"] for check in checks} <= {"PASS", "WARN", "FAIL", "SKIP"}
    assert any(check["outcome"] == "FAIL" for check in checks)
    shown = [line.split()[1] for line in as_json.stderr.splitlines() if not line.startswith(" ")]
    assert shown == [check["name"] for check in checks]
    assert as_json.stderr == text.output  # the same lines, on standard error
