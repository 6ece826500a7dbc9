"""``kvpool-agent`` with a weak token in its tokens file: refused at start in one line
naming the file, the role and the token's position (never its value); nothing made."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.mistakes import BIN, clean_environment


@pytest.mark.process
def test_kvpool_agent_refuses_a_weak_admin_token(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text('admins: "abc"\n')
    env = {
        **clean_environment(tmp_path),
        "KVPOOL_TOKENS_FILE": str(tokens),
        "KVPOOL_SEGMENT_PATH": str(tmp_path / "segment"),
        "KVPOOL_STATE_DIR": str(tmp_path / "state"),
        **{f"KVPOOL_{port}_PORT": "0" for port in ("ZMQ", "HTTP", "EVENTS")},
    }
    run = subprocess.run(
        [BIN / "kvpool-agent"], check=False, env=env, capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        f"kvpool-agent: KVPOOL_TOKENS_FILE={tokens}: admins: token #1 is too easy to guess "
        "(3 characters, 3 different); a token needs 32 characters or more, of 8 different "
        "ones at least: make one with `openssl rand -hex 24`"
    ]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tokens.yaml"]
