"""The console scripts, run as a user runs them: real processes."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import __version__
from kvpool.common.keys import tenant_id
from kvpool.common.segment import door_path

pytestmark = pytest.mark.process

BIN = Path(sys.executable).parent


def test_tenant_id_reads_the_salt_from_stdin_or_argument() -> None:
    from_stdin = subprocess.run(
        [BIN / "kvpool", "tenant-id"], input="s3cret\n", capture_output=True, text=True, check=True
    )
    assert from_stdin.stdout.strip() == tenant_id("s3cret")
    from_arg = subprocess.run(
        [BIN / "kvpool", "tenant-id", "s3cret"], capture_output=True, text=True, check=True
    )
    assert from_arg.stdout == from_stdin.stdout


HEAVY = ("boto3", "zmq", "fastapi", "uvicorn", "kopf", "kubernetes", "torch")
"""Libraries of the agent, the operator and vLLM that a tool's start must not pay for."""


def test_tenant_id_imports_no_library_of_another_part() -> None:
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvpool.tools.cli", "tenant-id", "x"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == tenant_id("x")
    # -X importtime: "import time: self [us] | cumulative | imported package", one per module
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in run.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "kvpool" in imported
    assert sorted(imported.intersection(HEAVY)) == []


def agent_env(segment: Path, state_dir: Path, **settings: str) -> dict[str, str]:
    """A 4 MiB agent on free ports, its segment and state where the test says; ``settings``
    become further KVPOOL_<NAME> variables."""
    merged = {
        "SEGMENT_PATH": str(segment),
        "L1_SIZE": "4MiB",
        "ZMQ_PORT": "0",
        "HTTP_PORT": "0",
        "EVENTS_PORT": "0",
        "STATE_DIR": str(state_dir),
        **settings,
    }
    return {**os.environ, **{f"KVPOOL_{name}": value for name, value in merged.items()}}


def wait_ready(agent: subprocess.Popen[str], timeout: float = 30.0) -> None:
    """Read the agent's log until it says it is ready."""
    assert agent.stderr is not None
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        lines.append(agent.stderr.readline())
        if "ready" in lines[-1]:
            return
    raise AssertionError(f"the agent did not get ready: {lines}")


def pool_directory(name: str) -> Iterator[Path]:
    """The segment's path in a directory of the test's own in /dev/shm (where the agent
    keeps its lock, probe table, chunk files and door beside it), removed afterwards."""
    directory = Path("/dev/shm") / f"kvpool-test-{name}-{os.getpid()}"
    try:
        yield directory / "segment"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def segment() -> Iterator[Path]:
    yield from pool_directory("cli")


def test_agent_starts_serves_and_stops_on_sigterm(tmp_path: Path, segment: Path) -> None:
    env = agent_env(segment, tmp_path)
    agent = subprocess.Popen([BIN / "kvpool-agent"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(agent)
        # the header and the chunk table of 64 pages: the chunks live in the chunk files
        assert segment.stat().st_size == 64 * 2**10
        assert door_path(segment).is_socket()
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=10) == 0
    finally:
        agent.kill()


def test_agent_refuses_invalid_configuration() -> None:
    env = {**os.environ, "KVPOOL_LOW_WATERMARK": "0.95"}
    result = subprocess.run(
        [BIN / "kvpool-agent"], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "low_watermark (0.95) must be below high_watermark (0.9)" in result.stderr


def test_a_broken_tokens_file_is_one_line_and_leaves_no_segment(
    tmp_path: Path, segment: Path
) -> None:
    secret = "pasted-token-0123456789abcdef0123456789"
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"{secret}: [a]\nadmins: [b]\n")  # a token pasted as a key
    env = agent_env(segment, tmp_path / "state", TOKENS_FILE=str(tokens))
    result = subprocess.run(
        [BIN / "kvpool-agent"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (error,) = [line for line in result.stderr.splitlines() if "kvpool-agent:" in line]
    assert error.startswith(f"kvpool-agent: KVPOOL_TOKENS_FILE={tokens}: unknown key")
    assert secret not in result.stderr
    assert not segment.exists()


def test_the_state_directory_is_private_whatever_the_umask(tmp_path: Path, segment: Path) -> None:
    state = tmp_path / "state"
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("admins: [an-admin-token-9f3c0e7a5d1b8264c0e7]\n")
    env = agent_env(segment, state, TOKENS_FILE=str(tokens))
    agent = subprocess.Popen(
        [BIN / "kvpool-agent"], env=env, stderr=subprocess.PIPE, text=True, umask=0
    )
    try:
        wait_ready(agent)
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=10) == 0
    finally:
        agent.kill()


def test_bench_l1_prints_its_table() -> None:
    result = subprocess.run(
        [BIN / "kvpool", "bench", "l1", "--chunks", "6400", "--lookups", "50", "--copy-mib", "32"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "prefix lookup with read lock, per chunk" in result.stdout
    assert "its own pages" in result.stdout and "pages of another" in result.stdout


def test_bench_chains_keeps_the_prefix_that_fits() -> None:
    sizes = ("--chain-mib", "24", "--fitting-mib", "19", "--l1-mib", "20")
    turns = ("--prompt-mib", "2", "--rounds", "2")
    result = subprocess.run(
        [BIN / "kvpool", "bench", "chains", *sizes, *turns],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["lru"]]
    *chains, in_turns = rows
    # reachable / fit at the low watermark, by L2 tiers and chain size: only a chain longer
    # than L1, with L2 tiers, may give up its head
    ratios = {(row[1], row[2]): row[-2] for row in chains}
    del ratios["yes", "24"]
    assert ratios == {("no", "24"): "1.00", ("no", "19"): "1.00", ("yes", "19"): "1.00"}, (
        result.stdout
    )
    assert in_turns[2] == in_turns[4] and in_turns[5] != "0", result.stdout  # all reachable


def test_bench_restart_prints_its_table() -> None:
    result = subprocess.run(
        [BIN / "kvpool", "bench", "restart", "--index-chunks", "2000"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "rebuild index" in result.stdout and "2,000 x 4 KiB" in result.stdout


def test_bench_service_prints_throughput_and_round_trips_against_the_zmq_floor() -> None:
    result = subprocess.run(
        [
            BIN / "kvpool", "bench", "service", "--working-set-mib", "4",
            "--chunk-sizes", str(256 << 10), "--clients", "1", "--lookups", "50",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=180,
    )  # fmt: skip
    assert "kvpool agent  256 KiB" in result.stdout
    for row in ("kvpool agent", "ping (no cache work)", "bare pyzmq: same bytes each way"):
        assert row in result.stdout.split("Locked lookup round trip")[1], result.stdout


def test_bench_tenants_prints_lookups_alone_and_while_metrics_is_polled() -> None:
    result = subprocess.run(
        [
            BIN / "kvpool", "bench", "tenants", "--tenants", "300", "--seconds", "0.3",
            "--runs", "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=180,
    )  # fmt: skip
    assert "300 tenants with a chunk each" in result.stdout, result.stdout
    for row in ("alone", "2 clients polling /healthz", "2 clients polling /metrics + /v1/status"):
        assert row in result.stdout, result.stdout


def test_every_console_script_says_its_version() -> None:
    for script in ("kvpool", "kvpool-agent", "kvpool-operator"):
        run = subprocess.run(
            [BIN / script, "--version"], capture_output=True, text=True, check=True, timeout=60
        )
        assert run.stdout == f"{script} {__version__}\n", run
