"""The test harness's agent process: a start that fails says so, with the agent's own words."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.agent_process import AgentProcess

pytestmark = pytest.mark.process


def test_an_agent_that_exits_at_start_is_an_error_with_its_log(tmp_path: Path) -> None:
    """Not an agent without endpoints: a bench or test would go on with an empty address."""
    process = AgentProcess(tmp_path, {"L1_SIZE": "lots"})
    try:
        with pytest.raises(RuntimeError, match="agent did not become ready") as raised:
            process.start(timeout=60)
        assert "KVPOOL_L1_SIZE" in str(raised.value)
        assert process.zmq == ""
    finally:
        process.cleanup()


def test_the_segment_path_of_the_settings_is_the_one_cleaned_up(tmp_path: Path) -> None:
    segment = Path("/dev/shm") / f"kvpool-harness-own-{tmp_path.name}"
    process = AgentProcess(tmp_path, {"SEGMENT_PATH": str(segment)})
    process.start()
    assert segment.exists()
    process.cleanup()
    assert not [path for path in segment.parent.iterdir() if path.name.startswith(segment.name)]
