"""The supported vLLM versions: the start-up check, and the docs page and Makefile stating them."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from kvpool.connector import compat

ROOT = Path(__file__).resolve().parents[2]
HOW = {"engine": "real engine", "api": "API only"}


@pytest.fixture(autouse=True)
def fresh_check() -> Iterator[None]:
    compat.check_vllm_version.cache_clear()
    yield
    compat.check_vllm_version.cache_clear()


@pytest.mark.parametrize("release", ["0.30.0", "0.31.2", "0.32.0", "0.32.0+cpu", "0.33.1rc1"])
def test_tested_minors_are_supported(release: str) -> None:
    assert compat.is_supported(release)


@pytest.mark.parametrize("release", ["0.29.9", "0.34.0", "1.0.0", "0.3.0", "not-a-version"])
def test_other_versions_are_not(release: str) -> None:
    assert not compat.is_supported(release)


def test_an_unsupported_vllm_is_named_once_with_the_range(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=compat.__name__)
    assert not compat.check_vllm_version("0.34.0")
    assert not compat.check_vllm_version("0.34.0")

    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "vLLM 0.34.0" in warnings[0].getMessage()
    assert "0.30.x to 0.33.x" in warnings[0].getMessage()


def test_a_supported_vllm_is_logged_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=compat.__name__)
    assert compat.check_vllm_version("0.32.0")
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_the_docs_table_states_what_is_tested() -> None:
    section = (ROOT / "docs" / "vllm" / "versions.md").read_text()
    rows = re.findall(r"^\| ([\w.]+) \| ([\w.]+) \| ([^|]+?) \|", section, re.MULTILINE)
    stated = {vllm: how for kvpool, vllm, how in rows if kvpool != "kvpool"}
    assert {kvpool for kvpool, _, _ in rows if kvpool != "kvpool"} == {version("kvpool")}
    assert {vllm: how.split(":")[0] for vllm, how in stated.items()} == {
        release: HOW[mode] for release, mode in compat.TESTED.items()
    }
    assert compat.supported_range() in section


def test_the_makefile_matrix_runs_every_tested_release() -> None:
    makefile = (ROOT / "Makefile").read_text()

    def variable(name: str) -> set[str]:
        match = re.search(rf"^{name} := (.*)$", makefile, re.MULTILINE)
        assert match, name
        return set(match.group(1).split())

    assert variable("VLLM_ENGINE") == {r for r, mode in compat.TESTED.items() if mode == "engine"}
    assert variable("VLLM_API") == {r for r, mode in compat.TESTED.items() if mode == "api"}
