"""``kvpool doctor`` run as a process against a real agent and the emulated API server."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.tools.doctor.report import NAME_WIDTH
from tests.support.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, AgentProcess

BIN = Path(sys.executable).parent
CHECK_NAMES = (
    "service",
    "protocol",
    "annotations",
    "agent",
    "door",
    "transport",
    "canary",
    "chunk-size",
    "fingerprint",
    "hit-rate",
    "peers",
    "picker",
    "model",
)


@dataclass(frozen=True)
class Line:
    outcome: str
    seen: str
    fix: str | None


@dataclass(frozen=True)
class Diagnosis:
    returncode: int
    output: str
    checks: dict[str, Line]
    stderr: str = ""
    """What the doctor wrote besides its lines (a traceback would be there)."""

    def outcomes(self) -> dict[str, str]:
        return {name: line.outcome for name, line in self.checks.items()}


def parse(output: str) -> dict[str, Line]:
    """The printed checks, by name: ``OUTCOME  name  seen``, then an indented ``fix:``."""
    checks: dict[str, Line] = {}
    fix_column = 4 + 2 + NAME_WIDTH + 2
    for line in output.splitlines():
        if line.startswith(" " * fix_column + "fix: "):
            name = list(checks)[-1]
            checks[name] = Line(checks[name].outcome, checks[name].seen, line[fix_column + 5 :])
            continue
        outcome, name, seen = line[:4], line[6 : 6 + NAME_WIDTH].strip(), line[fix_column:]
        assert outcome in ("PASS", "WARN", "FAIL", "SKIP"), line
        checks[name] = Line(outcome, seen, None)
    assert tuple(checks) == CHECK_NAMES, output
    return checks


def run_doctor(
    *args: str,
    env: dict[str, str] | None = None,
    as_a_pod: bool = False,
    own_shm_mib: int | None = None,
) -> Diagnosis:
    """``kvpool doctor ARGS`` in a process of its own.

    ``as_a_pod``: the way a vLLM container runs, without the capabilities that let root
    ignore file modes (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so that a file's owner and
    mode apply to it as to any uid. Needs setpriv (util-linux) when run as root.
    ``own_shm_mib``: in a mount namespace whose /dev/shm is a tmpfs of its own of that
    size, as in a pod that is not given the agent's door (nothing of the node's /dev/shm
    is there). Needs unshare (util-linux).
    """
    command = [str(BIN / "kvpool"), "doctor", *args]
    if own_shm_mib is not None:
        if shutil.which("unshare") is None:
            pytest.skip("unshare (util-linux) is needed for a /dev/shm of the doctor's own")
        mount = f'mount -t tmpfs -o size={own_shm_mib}m tmpfs /dev/shm && exec "$@"'
        user_namespace = ["--map-root-user"] if os.geteuid() != 0 else []
        command = [
            "unshare", "--mount", "--propagation", "private", *user_namespace,
            "sh", "-c", mount, "sh", *command,
        ]  # fmt: skip
    if as_a_pod and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) is needed to drop root's file capabilities")
        drop = "-dac_override,-dac_read_search"
        command = [setpriv, f"--bounding-set={drop}", "--inh-caps=-all", *command]
    result = subprocess.run(
        command,
        env={**clean_env(), "KVPOOL_CONNECTOR_TOKEN": ENGINE_TOKEN, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode in (0, 1), result.stderr
    return Diagnosis(result.returncode, result.stdout, parse(result.stdout), result.stderr)


def clean_env() -> dict[str, str]:
    """This environment without a cluster's or kvpool's settings, and with a home of its own
    (empty): an agent another test runs on the embedded default writes its tokens into
    ``~/.local/state/kvpool`` meanwhile, where the doctor would find them."""
    return {
        **{
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("KVPOOL_", "KUBERNETES_")) and key != "KUBECONFIG"
        },
        "HOME": str(_EMPTY_HOME),
    }


_EMPTY_HOME = Path(tempfile.mkdtemp(prefix="kvpool-doctor-home-"))
atexit.register(shutil.rmtree, _EMPTY_HOME, ignore_errors=True)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    """A real agent with an admin token (ADMIN_TOKEN)."""
    process = AgentProcess(tmp_path)
    process.start()
    yield process
    process.cleanup()


def agent_args(agent: AgentProcess) -> list[str]:
    """The doctor's arguments for ``agent`` without Kubernetes, with its HTTP API."""
    return ["--endpoint", agent.zmq, "--http", agent.http]


ADMIN_ENV = {"KVPOOL_ADMIN_TOKEN": ADMIN_TOKEN}
