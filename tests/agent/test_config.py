from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvpool.common.config import AgentConfig


def test_defaults_are_the_embedded_agent() -> None:
    config = AgentConfig()
    assert config.l1_size == 1 << 30 and config.page_size == 64 << 10
    assert (config.high_watermark, config.low_watermark) == (0.90, 0.80)
    assert config.resolved_segment_path == Path("/dev/shm/kvpool-default/segment")


def test_sources_file_then_env_then_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "agent.yaml"
    file.write_text("pool: from-file\nl1_size: 2GiB\neviction_policy: arc\n")
    monkeypatch.setenv("KVPOOL_CONFIG_FILE", str(file))
    monkeypatch.setenv("KVPOOL_EVICTION_POLICY", "lru")
    config = AgentConfig(pool="from-args")
    assert config.pool == "from-args"
    assert config.l1_size == 2 << 30
    assert config.eviction_policy == "lru"


def test_json_file_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "agent.json"
    file.write_text('{"default_tenant_quota": "512MiB"}')
    monkeypatch.setenv("KVPOOL_CONFIG_FILE", str(file))
    assert AgentConfig().default_tenant_quota == 512 << 20


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"low_watermark": 0.9, "high_watermark": 0.8}, "must be below"),
        ({"page_size": 5000}, "power of two"),
        ({"page_size": 1024}, "power of two"),
        ({"l1_size": "64KiB"}, "at least 16 pages"),
        ({"eviction_policy": "fifo"}, "known policies are lru, arc"),
        ({"pool": "Bad_Name"}, "pattern"),
        ({"unknown_field": 1}, "Extra inputs"),
        ({"high_watermark": 1.5}, "less than or equal"),
    ],
)
def test_invalid_settings_are_refused_with_a_reason(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        AgentConfig(**settings)  # type: ignore[arg-type]


def test_a_file_that_is_not_a_mapping_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "agent.yaml"
    file.write_text("- a\n- list\n")
    monkeypatch.setenv("KVPOOL_CONFIG_FILE", str(file))
    with pytest.raises(ValueError, match="expected a mapping"):
        AgentConfig()
