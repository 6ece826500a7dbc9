"""Each part installs alone and starts: the base distribution (the connector and the client),
``[agent]``, ``[operator]`` and ``[index]``, each into a clean virtual environment of its own
(no system site-packages, no other extra), from one wheel built from this tree. Each runs its
console scripts (``--help``, and a real start where one is cheap: the agent and the index),
and a script whose extra is missing says which extra to install, in one line. Takes a few
minutes (pip)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

BASE_MODULES = ("kvpool.client", "kvpool.common.keys", "kvpool.common.protocol")
CONNECTOR_NEEDS_VLLM = {
    # vLLM (and torch) come with the engine's image, not with kvpool: these import them
    # at module level, so a venv without vLLM cannot import them.
    "kvpool.connector.facade": "vllm (the KVConnectorBase_V1 that vLLM loads)",
    "kvpool.connector.groups": "vllm (its KV cache spec types)",
    "kvpool.connector.metadata": "vllm (KVConnectorMetadata)",
    "kvpool.connector.metrics": "vllm (KVConnectorPromMetrics)",
    "kvpool.connector.scheduler": "vllm, through metadata",
    "kvpool.connector.scheduler_requests": "torch, through layout",
    "kvpool.connector.scheduler_lookups": "torch, through scheduler_requests",
    "kvpool.connector.scheduler_loads": "torch, through layout",
    "kvpool.connector.scheduler_stores": "torch, through scheduler_requests",
    "kvpool.connector.worker": "torch (vLLM's KV tensors)",
    "kvpool.connector.worker_transport": "torch, through copier",
    "kvpool.connector.worker_loads": "torch (the loads' tensors)",
    "kvpool.connector.worker_stores": "torch (the stores' tensors)",
    "kvpool.connector.copier": "torch (the copy primitive)",
    "kvpool.connector.staged": "torch (the GPU copies)",
    "kvpool.connector.fused": "torch (the GPU copies' fused kernel)",
    "kvpool.connector.layout": "torch (shapes and strides of vLLM's KV cache)",
}
CLEAN = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
"""The venv's own packages only, not a source tree on the path."""
LIBRARIES = {
    # what each extra brings that the others may lack (module names)
    "agent": ("fastapi", "uvicorn", "boto3", "cryptography"),
    "operator": ("kopf", "uvicorn", "starlette"),
    "index": ("fastapi", "uvicorn"),
}
NOT_IN = {
    "": ("kopf", "boto3", "fastapi", "uvicorn", "pydantic_settings"),
    "agent": ("kopf",),
    "operator": ("fastapi", "boto3"),
    "index": ("kopf", "boto3"),
}
SCRIPTS = {
    # a command, and the extra it needs
    ("kvpool-agent",): "agent",
    ("kvpool-operator",): "operator",
    ("kvpool", "index"): "index",
    ("kvpool-index",): "index",
    ("kvpool", "doctor"): "agent",
    ("kvpool", "bench", "l1"): "bench",
}
EXTRAS = ("", "agent", "operator", "index")
RUNS = {
    "": (),
    "agent": ("agent", "bench"),
    "operator": ("operator",),
    "index": ("index",),
}
"""The extras whose scripts run in each venv (the index's endpoint picker needs gRPC,
Envoy's ext_proc stubs and tokenizers, which the agent does not)."""

IMPORT_ALL = """
import importlib, json, pkgutil, sys
import kvpool.connector as connector
excluded = set(sys.argv[1].split(","))
names = [f"kvpool.connector.{m.name}" for m in pkgutil.iter_modules(connector.__path__)]
for name in [*sys.argv[2].split(","), *names]:
    if name not in excluded:
        importlib.import_module(name)
found = [n for n in sys.argv[3].split(",") if importlib.util.find_spec(n) is not None]
print(json.dumps({"connector": names, "found": found}))
"""


@pytest.fixture(scope="module", params=EXTRAS, ids=lambda extra: extra or "base")
def venv(
    request: pytest.FixtureRequest, wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """The ``bin`` of a clean venv with kvpool and one extra (or none) installed."""
    extra: str = request.param
    venv = tmp_path_factory.mktemp(f"venv-{extra or 'base'}")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    requirement = f"kvpool[{extra}] @ {wheel.as_uri()}" if extra else str(wheel)
    install = subprocess.run(
        [
            venv / "bin/python",
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            requirement,
        ],
        capture_output=True,
        text=True,
        check=False,
        env=CLEAN,
    )
    assert install.returncode == 0, install.stderr
    yield extra, venv / "bin"


def _run(*command: str | Path, env: Mapping[str, str] = CLEAN) -> subprocess.CompletedProcess[str]:
    # a script that runs instead of answering fails here, not at pytest's limit
    return subprocess.run(command, capture_output=True, text=True, check=False, env=env, timeout=60)


def _found(bin_dir: Path, modules: tuple[str, ...]) -> list[str]:
    check = (
        "import importlib.util, sys; "
        "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m)))"
    )
    return _run(bin_dir / "python", "-c", check, *modules).stdout.split()


def test_each_extra_brings_its_libraries_and_not_the_others(venv: tuple[str, Path]) -> None:
    extra, bin_dir = venv
    assert _found(bin_dir, LIBRARIES.get(extra, ())) == list(LIBRARIES.get(extra, ()))
    assert _found(bin_dir, NOT_IN[extra]) == []


def test_the_base_imports_the_connector_and_the_client(venv: tuple[str, Path]) -> None:
    _, bin_dir = venv
    run = _run(
        bin_dir / "python",
        "-c",
        IMPORT_ALL,
        ",".join(CONNECTOR_NEEDS_VLLM),
        ",".join(BASE_MODULES),
        "",
    )
    assert run.returncode == 0, run.stderr
    # the exclusions name real modules: a module renamed or gone is noticed here
    assert set(CONNECTOR_NEEDS_VLLM) <= set(json.loads(run.stdout)["connector"])
    tenant = _run(bin_dir / "kvpool", "tenant-id", "x")
    assert tenant.returncode == 0 and len(tenant.stdout.strip()) == 32, tenant.stderr


def test_a_script_answers_help_or_names_its_missing_extra_in_one_line(
    venv: tuple[str, Path],
) -> None:
    extra, bin_dir = venv
    for (script, *arguments), needs in SCRIPTS.items():
        if needs in RUNS[extra]:
            run = _run(bin_dir / script, *arguments, "--help")
            assert run.returncode == 0, (script, arguments, run.stderr)
            assert "usage:" in run.stdout, run.stdout
        else:
            run = _run(bin_dir / script, *arguments)
            assert run.returncode == 1, (script, arguments, run.stderr)
            assert run.stderr.count("\n") == 1, run.stderr  # no traceback
            assert f"needs kvpool's '{needs}' extra" in run.stderr, run.stderr
            assert f"-py3-none-any.whl[{needs}]'" in run.stderr, run.stderr


@contextlib.contextmanager
def started(
    command: list[str | Path], env: Mapping[str, str], ready: str
) -> Iterator[re.Match[str]]:
    """Start ``command`` and wait (bounded by its own startup limits) for a log line matching
    ``ready``; yield the match; then SIGTERM it, and it must exit 0."""
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    try:
        found = next(filter(None, (re.search(ready, line) for line in process.stderr)), None)
        assert found is not None, f"{command[0]} exited with {process.wait()} before it was ready"
        yield found
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("venv", ["agent"], indirect=True)
def test_the_agent_starts_and_stops_on_its_extra(venv: tuple[str, Path], tmp_path: Path) -> None:
    _, bin_dir = venv
    directory = Path("/dev/shm") / f"kvpool-packaging-{os.getpid()}"
    segment = directory / "segment"  # its lock, table, chunk files and door beside it
    settings = {
        "POOL": "packaging",
        "SEGMENT_PATH": str(segment),
        "L1_SIZE": "16MiB",
        "ZMQ_PORT": "0",
        "HTTP_PORT": "0",
        "EVENTS_PORT": "0",
        "STATE_DIR": str(tmp_path / "state"),
    }
    env = {**CLEAN, **{f"KVPOOL_{name}": value for name, value in settings.items()}}
    try:
        with started([bin_dir / "kvpool-agent"], env, r"agent ready pool=packaging ") as found:
            assert f"segment={segment}" in found.string
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("venv", ["index"], indirect=True)
def test_the_index_starts_and_answers_on_its_extra(venv: tuple[str, Path], tmp_path: Path) -> None:
    _, bin_dir = venv
    agent_token = tmp_path / "agent-token"  # what the index follows the agents with
    agent_token.write_text("an-index-token-of-the-pool\n")
    env = {
        **CLEAN,
        "KVPOOL_INDEX_HTTP_PORT": "0",
        "KVPOOL_INDEX_STATE_DIR": str(tmp_path / "state"),
        "KVPOOL_INDEX_AGENT_TOKEN_FILE": str(agent_token),
    }
    agent = "--agent=node-1=tcp://127.0.0.1:9,tcp://127.0.0.1:9"  # never answers: fine
    with (
        started(
            [bin_dir / "kvpool-index", agent], env, r"index ready pool=\S+ http=(\S+)"
        ) as found,
        urllib.request.urlopen(f"{found.group(1)}/healthz", timeout=5) as answer,
    ):
        assert answer.status == 200
