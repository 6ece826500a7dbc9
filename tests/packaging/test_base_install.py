"""The base distribution, installed for real into a clean virtual environment (no system
site-packages, no extras), is enough for the vLLM connector and the client, and holds
none of the agent's, operator's or index's libraries. Takes about a minute (pip)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "agent", "operator")
"""What the package is built from (the Dockerfile copies the same)."""
BASE_MODULES = ("kvpool_agent.client", "kvpool_agent.keys", "kvpool_agent.protocol")
CONNECTOR_NEEDS_VLLM = {
    # vLLM (and torch) come with the engine's image, not with kvpool: these import them
    # at module level, so a venv without vLLM cannot import them.
    "kvpool_agent.connector.facade": "vllm (the KVConnectorBase_V1 that vLLM loads)",
    "kvpool_agent.connector.metadata": "vllm (KVConnectorMetadata)",
    "kvpool_agent.connector.metrics": "vllm (KVConnectorPromMetrics)",
    "kvpool_agent.connector.scheduler": "vllm, through metadata",
    "kvpool_agent.connector.worker": "torch (vLLM's KV tensors)",
    "kvpool_agent.connector.copier": "torch (the copy primitive)",
    "kvpool_agent.connector.layout": "torch (shapes and strides of vLLM's KV cache)",
}
CLEAN = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
"""The venv's own packages only, not a source tree on the path."""
NOT_IN_BASE = ("kopf", "boto3", "fastapi", "uvicorn")
EXTRA_OF_SCRIPT = {
    ("kvpool-agent",): "agent",
    ("kvpool-operator",): "operator",
    ("kvpool", "index"): "index",
    ("kvpool", "doctor", "--pool", "main"): "agent",
    ("kvpool", "bench", "l1"): "agent",
}

IMPORT_ALL = """
import importlib, json, pkgutil, sys
import kvpool_agent.connector as connector
excluded = set(sys.argv[1].split(","))
names = [f"kvpool_agent.connector.{m.name}" for m in pkgutil.iter_modules(connector.__path__)]
for name in [*sys.argv[2].split(","), *names]:
    if name not in excluded:
        importlib.import_module(name)
found = [n for n in sys.argv[3].split(",") if importlib.util.find_spec(n) is not None]
print(json.dumps({"connector": names, "found": found}))
"""


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("base-install")
    source = work / "src"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            shutil.copy(ROOT / name, source / name)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run(
        [
            venv / "bin/python",
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            source,
        ],
        check=True,
        capture_output=True,
        env=CLEAN,
    )
    return venv / "bin"


def test_the_base_imports_the_connector_and_the_client_without_the_extras(
    base_venv: Path,
) -> None:
    run = subprocess.run(
        [
            base_venv / "python",
            "-c",
            IMPORT_ALL,
            ",".join(CONNECTOR_NEEDS_VLLM),
            ",".join(BASE_MODULES),
            ",".join(NOT_IN_BASE),
        ],
        capture_output=True,
        text=True,
        check=False,
        env=CLEAN,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    # the exclusions name real modules: a module renamed or gone is noticed here
    assert set(CONNECTOR_NEEDS_VLLM) <= set(result["connector"])
    assert result["found"] == []


def test_a_script_whose_extra_is_missing_names_it_in_one_line(base_venv: Path) -> None:
    for (script, *arguments), extra in EXTRA_OF_SCRIPT.items():
        run = subprocess.run(
            [base_venv / script, *arguments],
            capture_output=True,
            text=True,
            check=False,
            env=CLEAN,
            timeout=60,  # a script that runs instead of refusing fails here, not in pytest's limit
        )
        assert run.returncode == 1, (script, arguments, run.stderr)
        assert run.stderr.count("\n") == 1, run.stderr  # no traceback
        assert f"pip install 'kvpool[{extra}]'" in run.stderr, run.stderr
    tenant = subprocess.run(
        [base_venv / "kvpool", "tenant-id", "x"],
        capture_output=True,
        text=True,
        check=True,
        env=CLEAN,
    )
    assert len(tenant.stdout.strip()) > 0
