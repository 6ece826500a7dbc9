from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.tools import KUBERNETES_VERSION, ROOT, Tools, ToolsUnavailable, tools

CHART = ROOT / "charts" / "kvpool"
VALUES = Path(__file__).with_name("values")
RELEASE = "kvpool"
NAMESPACE = "kvpool-system"
Manifest = dict[str, Any]


@dataclass(frozen=True)
class Helm:
    """helm 4 against the chart, offline."""

    binary: Path

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check:
            assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}"
        return result

    def template(
        self, *values: str, sets: tuple[str, ...] = (), crds: bool = True
    ) -> list[Manifest]:
        """Every object ``helm template`` renders with these values files (from VALUES)."""
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        args += ["--kube-version", KUBERNETES_VERSION]
        args += ["--include-crds"] if crds else []
        for name in values:
            args += ["--values", str(VALUES / name)]
        for assignment in sets:
            args += ["--set", assignment]
        output = self.run(*args).stdout
        return [doc for doc in yaml.safe_load_all(output) if doc]

    def notes(self, *values: str) -> str:
        """The NOTES.txt an install would print (a client-side dry run)."""
        args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
        for name in values:
            args += ["--values", str(VALUES / name)]
        release = json.loads(self.run(*args, "--output", "json").stdout)
        notes: str = release["info"]["notes"]
        return notes


@pytest.fixture(scope="session")
def binaries() -> Tools:
    try:
        return tools()
    except ToolsUnavailable as error:
        pytest.skip(f"helm and kubectl are unavailable: {error}")


@pytest.fixture(scope="session")
def helm(binaries: Tools) -> Helm:
    return Helm(binaries.helm)


def by_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [manifest for manifest in manifests if manifest["kind"] == kind]


def one(manifests: list[Manifest], kind: str) -> Manifest:
    (found,) = by_kind(manifests, kind)
    return found
