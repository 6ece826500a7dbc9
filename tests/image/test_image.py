"""The container image, checked without a Docker engine: the Dockerfile's structure, base,
user and commands, and what .dockerignore lets into the build context."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from kvpool.operator.render import AGENT_UID, Pool, render
from kvpool.operator.spec import PoolSpec, PortsSpec

from .dockerfile import DockerIgnore, Stage, copy_sources, parse

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STAGES = parse((ROOT / "Dockerfile").read_text())
FINAL = STAGES[-1]
IGNORE = DockerIgnore.read(ROOT / ".dockerignore")
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
CHART_VALUES = yaml.safe_load((ROOT / "charts/kvpool/values.yaml").read_text())
PINNED = re.compile(r"^[\w.\-/]+:(\d+)\.(\d+)\.\d+[\w.\-]*@sha256:[0-9a-f]{64}$")
SECRET_LIKE = re.compile(
    r"(^|/)(\.env(\..*)?|.*\.(pem|key|crt|p12|pfx)|id_(rsa|ecdsa|ed25519).*|.*kubeconfig.*"
    r"|.*token.*|.*secret.*|.*credential.*|\.netrc|\.pypirc|\.git|\.aws|\.docker)(/|$)",
    re.IGNORECASE,
)
NOT_IN_CONTEXT = [
    ".git/config",
    ".git/objects/ab/cdef",
    ".venv/bin/python",
    ".venv/lib/python3.11/site-packages/torch/__init__.py",
    ".env",
    ".env.local",
    "src/.env",
    "tokens.yaml",
    "tokens-prod.yaml",
    "src/kvpool/tokens.yaml",
    "src/kvpool/operator/kubeconfig",
    "kubeconfig.yaml",
    "server.pem",
    "src/kvpool/agent/server.key",
    "id_rsa",
    "src/kvpool/operator/id_ed25519.pub",
    ".aws/credentials",
    ".docker/config.json",
    ".netrc",
    "my-secret.json",
    "src/kvpool/__pycache__/keys.cpython-311.pyc",
    "kvpool.egg-info/PKG-INFO",
    ".pytest_cache/kvpool-tools/helm",
    ".mypy_cache/3.11/x.json",
    "tests/agent/test_keys.py",
    "e2e/run.py",
    "charts/kvpool/values.yaml",
    "crds/kvcachepools.kvpool.io.yaml",
    "Makefile",
    ".ci/run",
]


def _stage_names() -> set[str]:
    return {stage.name for stage in STAGES if stage.name}


def test_the_build_is_multi_stage_and_ships_only_what_it_built() -> None:
    assert len(STAGES) >= 2
    copies = FINAL.of("COPY") + FINAL.of("ADD")
    assert copies, "the final stage copies the build's result"
    for instruction in copies:
        assert instruction.flags().get("from") in _stage_names(), (
            f"line {instruction.line}: the final stage copies only from earlier stages"
        )
    for run in FINAL.of("RUN"):
        assert not re.search(r"pip install|apt-get install|gcc|make\b", run.arguments), run


def test_the_base_images_are_pinned_by_version_and_digest() -> None:
    for stage in STAGES:
        if stage.base in _stage_names():
            continue
        match = PINNED.match(stage.base)
        assert match is not None, f"FROM {stage.base}: pin a versioned tag and a sha256 digest"
        if "python" in stage.base:
            # the image's Python is the one the tests run on
            assert (int(match[1]), int(match[2])) == sys.version_info[:2], stage.base


def test_the_image_runs_as_a_numeric_non_root_user() -> None:
    (*_, user) = FINAL.of("USER")
    match = re.fullmatch(r"(\d+)(?::(\d+))?", user.arguments)
    assert match is not None, f"USER {user.arguments}: numeric, so runAsNonRoot can check it"
    uid = int(match[1])
    assert uid != 0 and int(match[2] or uid) != 0
    # the user the agents' pods (operator) and the operator's pod (chart) run as
    assert uid == AGENT_UID == CHART_VALUES["operator"]["runAsUser"]
    assert any(f"--uid {uid}" in run.arguments for run in FINAL.of("RUN")), "the user exists"


def _commands() -> set[str]:
    """What runs in the image: its CMD, the chart's operator, the operator's agents."""
    (*_, cmd) = FINAL.of("CMD")
    assert cmd.is_exec_form(), "exec form: the command gets the signals (SIGTERM)"
    chart = (ROOT / "charts/kvpool/templates/deployment.yaml").read_text()
    operator = re.search(r"command: \[([\w-]+)\]", chart)
    assert operator is not None
    children = render(Pool("main", "ns", "uid"), PoolSpec.parse({}), default_image="x")
    (agent,) = children.daemonset["spec"]["template"]["spec"]["containers"]
    return {cmd.words()[0], operator[1], agent["command"][0]}


def test_every_command_the_image_runs_is_a_console_script() -> None:
    commands = _commands()
    assert commands == {"kvpool-agent", "kvpool-operator"}
    assert commands <= SCRIPTS.keys()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_console_script_runs(script: str) -> None:
    result = subprocess.run(
        [str(BIN / script), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    build = " ".join(run.arguments for stage in STAGES for run in stage.of("RUN"))
    assert f"/opt/kvpool/bin/{script} --help" in build, "the build checks it runs too"


def test_the_image_exposes_the_default_ports() -> None:
    exposed = {int(port.split("/")[0]) for e in FINAL.of("EXPOSE") for port in e.words()}
    ports = PortsSpec()
    assert {ports.zmq, ports.http, ports.events, CHART_VALUES["operator"]["healthPort"]} <= exposed


def test_nothing_secret_is_copied_or_baked_in() -> None:
    for stage in STAGES:
        for instruction in stage.of("COPY") + stage.of("ADD"):
            for source in copy_sources(instruction):
                assert not re.match(r"^[a-z]+://", source), f"ADD of a URL: {source}"
                assert not SECRET_LIKE.search(source), f"line {instruction.line}: {source}"
        for instruction in stage.of("ENV") + stage.of("ARG"):
            names = re.findall(r"(\w+)=", instruction.arguments) or instruction.words()[:1]
            for name in names:
                assert not re.search(r"TOKEN|SECRET|PASSWORD|CREDENTIAL|_KEY", name, re.I), name


def test_what_the_build_copies_is_in_the_context() -> None:
    for stage in STAGES:
        for instruction in stage.of("COPY"):
            if "from" in instruction.flags():
                continue
            for source in copy_sources(instruction):
                assert (ROOT / source).exists(), source
                assert not IGNORE.excluded(source), f".dockerignore excludes {source}"


def test_the_package_sources_are_all_in_the_context() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "src"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert listed
    assert [path for path in listed if IGNORE.excluded(path)] == []
    for needed in ("pyproject.toml", "README.md"):  # pyproject's readme
        assert not IGNORE.excluded(needed)


@pytest.mark.parametrize("path", NOT_IN_CONTEXT)
def test_secrets_and_tooling_stay_out_of_the_context(path: str) -> None:
    assert IGNORE.excluded(path)


def test_the_real_context_is_the_package_and_nothing_secret() -> None:
    files = IGNORE.context(ROOT)
    assert "pyproject.toml" in files
    outside = [f for f in files if f not in ("pyproject.toml", "README.md")]
    assert all(f.startswith("src/") for f in outside), outside
    assert [f for f in files if SECRET_LIKE.search(f)] == []
    assert [f for f in files if "__pycache__" in f or f.endswith(".pyc")] == []


@pytest.mark.parametrize(
    ("patterns", "path", "excluded"),
    [
        ("*.pem", "server.pem", True),
        ("*.pem", "agent/server.pem", False),  # '*' stays within the top directory
        ("**/*.pem", "agent/x/server.pem", True),
        ("tests", "tests/agent/test_keys.py", True),  # a parent directory matches
        ("*\n!src", "src/kvpool/common/keys.py", False),
        ("*\n!agent\n**/__pycache__", "agent/a/__pycache__/b.pyc", True),
        ("*\n!agent\n**/__pycache__", "agent/a/b.py", False),
        ("/secrets/", "secrets/key", True),  # cleaned: leading and trailing '/'
        ("doc?.md", "docs.md", True),
        ("doc?.md", "doc/.md", False),
        ("*.py[cod]", "x.pyc", True),
        ("# comment\n\n.git", ".git/HEAD", True),
    ],
)
def test_dockerignore_semantics(patterns: str, path: str, excluded: bool) -> None:
    assert DockerIgnore(patterns).excluded(path) is excluded


def _stage(name: str) -> Stage:
    (stage,) = [stage for stage in STAGES if stage.name == name]
    return stage


def test_the_runtime_environment() -> None:
    env = " ".join(instruction.arguments for instruction in _stage("runtime").of("ENV"))
    assert "PATH=/opt/kvpool/bin:$PATH" in env
    assert "KVPOOL_STATE_DIR=/var/lib/kvpool" in env
