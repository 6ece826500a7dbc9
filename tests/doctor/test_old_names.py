"""``kvpool doctor`` reads the connector's variables as the connector does, by their new
names and their old ones; ``--pool`` asks for the pool's Service, whatever endpoint a pod's
variables name, by either name."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_doctor

pytestmark = pytest.mark.process


def test_pool_wins_over_the_endpoint_by_either_name(tmp_path: Path) -> None:
    """Both endpoint variables are dropped before they are read: neither the malformed old
    one nor the two that differ is refused (exit 2); the doctor asks for the Service."""
    env = {
        "KUBECONFIG": str(tmp_path / "absent"),
        "KVPOOL_ENDPOINT": "localhost:7400",
        "KVPOOL_CONNECTOR_ENDPOINT": "tcp://elsewhere:7400",
    }
    diagnosis = run_doctor("--pool", "main", "--namespace", "ns", "--timeout", "1", env=env)
    assert diagnosis.returncode == 1
    assert diagnosis.checks["service"].seen.startswith("no Kubernetes credentials")
    assert diagnosis.outcomes()["agent"] == "SKIP"  # discovery failed: nothing dialled
    assert "7400" not in diagnosis.output + diagnosis.stderr
