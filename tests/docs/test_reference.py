"""The reference pages under ``docs/reference/`` are what the code generates
(``python -m kvpool.tools.reference``), and the settings page holds every setting; the
example agent configuration is one the agent takes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from kvpool.common.config import AgentConfig, NvmeTierConfig, ZmqLimits, load_settings
from kvpool.tools.reference import settings
from kvpool.tools.reference.__main__ import main
from kvpool.tools.reference.pages import PAGES, Page
from tests.docs.examples import DOCS, ROOT

EXAMPLE = ROOT / "examples" / "agent.yaml"
LIMITS = ("http_limits", "zmq_limits")
"""Settings whose fields have rows of their own (``http_limits.max_body_bytes``...)."""


@pytest.mark.process
@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.path)
def test_the_page_is_what_the_code_says(page: Page) -> None:
    written = DOCS / page.path
    assert written.exists(), f"{written} is missing: run python -m kvpool.tools.reference"
    assert written.read_text() == page.text(), (
        f"{written} differs from what the code generates: run python -m kvpool.tools.reference"
    )


def test_check_fails_on_a_stale_page_and_writing_fixes_it(tmp_path: Path) -> None:
    page = "reference/settings.md"
    stale = tmp_path / page
    stale.parent.mkdir()
    stale.write_text((DOCS / page).read_text().replace("| `l1_size` |", "| `l1.size` |"))
    assert main(["--docs", str(tmp_path), "--check", page]) == 1
    assert main(["--docs", str(tmp_path), page]) == 0
    assert main(["--docs", str(tmp_path), "--check", page]) == 0
    assert stale.read_text() == (DOCS / page).read_text()


def test_every_setting_is_in_the_reference() -> None:
    section = settings.render()
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
