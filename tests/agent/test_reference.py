"""The README's configuration reference is generated from the models, and the example
configuration is one the agent takes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from kvpool_agent import reference
from kvpool_agent.config import AgentConfig, NvmeTierConfig, ZmqLimits, load_settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "agent.yaml"
LIMITS = ("http_limits", "zmq_limits")
"""Settings whose fields have rows of their own (``http_limits.max_body_bytes``...)."""


def test_the_readme_reference_is_what_the_models_say() -> None:
    written = reference.section(README.read_text())
    assert written, f"{README} has no section between the markers {reference.BEGIN!r}"
    assert written == reference.render(), (
        "the README's configuration reference differs from the models: run "
        "python -m kvpool_agent.reference"
    )


def test_every_setting_is_in_the_reference() -> None:
    section = reference.render()
    for name, field in AgentConfig.model_fields.items():
        assert f"| `{name}` | `KVPOOL_{name.upper()}`" in section or name in LIMITS
        assert field.description, name
    for name in NvmeTierConfig.model_fields:
        assert f"| `nvme.{name}` | `KVPOOL_NVME__{name.upper()}` |" in section
    for row in ("`events_port`", "`store_policy`", "`store_min_hits`", "`writeback_queue_chunks`"):
        assert f"| {row} |" in section
    assert "| `l1_size` | `KVPOOL_L1_SIZE` | `1Gi` |" in section
    for name in ZmqLimits.model_fields:
        assert f"| `zmq_limits.{name}` | `KVPOOL_ZMQ_LIMITS__{name.upper()}` |" in section
    assert (
        "| `http_limits.max_body_bytes` | `KVPOOL_INDEX_HTTP_LIMITS__MAX_BODY_BYTES` | `16Mi` |"
        in section
    )


def test_check_fails_on_a_stale_readme(tmp_path: Path) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(README.read_text().replace("| `l1_size` |", "| `l1.size` |"))
    assert reference.main([str(stale), "--check"]) == 1
    assert reference.main([str(stale)]) == 0
    assert reference.main([str(stale), "--check"]) == 0
    assert stale.read_text() == README.read_text()


def test_the_example_configuration_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVPOOL_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVPOOL_CONFIG_FILE", str(EXAMPLE))
    config = load_settings(AgentConfig)
    assert config.nvme is not None
    assert (config.l1_size, config.nvme.capacity) == (64 << 30, 500 << 30)
    written = yaml.safe_load(EXAMPLE.read_text())
    assert set(written["nvme"]) == set(NvmeTierConfig.model_fields)  # every NVMe setting
