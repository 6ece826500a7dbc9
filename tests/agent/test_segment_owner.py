"""One agent owns a segment (issue 28): real agents, started side by side.

A second agent for a live segment refuses to start in one line naming the segment and the
live agent, and changes nothing of the first's (its segment, token files, probe table,
lock, clients), whether its L1 size is the same or another; so does one with a segment of
its own but the first's state directory, or NVMe tree, and pool. A rollout's new agent
waits for the old one to exit, then adopts the segment with every chunk. A start that fails
leaves no file it made, and never removes nor changes a segment an earlier agent left, even
one of another L1 size that it would have replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.client import AgentClient
from kvpool.common.keys import tenant_id
from tests.support.agent_process import AgentProcess
from tests.support.chunks import key

pytestmark = pytest.mark.process

TENANT = tenant_id("owner-a")
CHUNKS = 16
SIZE = 10_000
TOKEN_FILES = ("admin-token-default", "engine-token-default", "index-token-default")


def payload(name: int) -> bytes:
    return random.Random(name).randbytes(SIZE)


def fingerprint(path: Path) -> tuple[int, int, str] | None:
    """Inode, size and content digest of a file ("directory" or "socket" for one); None if
    there is none."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    if path.is_dir():
        return status.st_ino, 0, "directory"
    if path.is_socket():
        return status.st_ino, 0, "socket"
    return status.st_ino, status.st_size, hashlib.sha256(path.read_bytes()).hexdigest()


def listing(directory: Path) -> dict[str, tuple[int, int, str] | None]:
    if not directory.exists():
        return {}
    return {
        str(entry.relative_to(directory)): fingerprint(entry)
        for entry in sorted(directory.rglob("*"))
    }


def shm_names(agent: AgentProcess) -> list[str]:
    """Everything in /dev/shm named after the agent's segment (its temporaries too)."""
    name = agent.segment_path.name
    return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.lstrip(".").startswith(name))


def everything(agent: AgentProcess) -> dict[str, object]:
    """What a second agent must not change: the first's files in /dev/shm and its state."""
    shm = Path("/dev/shm")
    return {  # the chunk files and the door are directories: what is in them too
        "shm": {name: (fingerprint(shm / name), listing(shm / name)) for name in shm_names(agent)},
        "state": listing(agent.workdir / "state"),
    }


@pytest.fixture
def second(agent_process: AgentProcess) -> Iterator[AgentProcess]:
    """Another agent process for the first's very segment and state directory."""
    process = AgentProcess(agent_process.workdir, generate_tokens=agent_process.generate_tokens)
    yield process
    process.kill()  # the first's fixture removes the files


def store(agent: AgentProcess, client: AgentClient, names: range) -> None:
    assert client.store(TENANT, [key(n) for n in names], [payload(n) for n in names]) == len(names)


@pytest.mark.parametrize("l1_size", ["4MiB", "8MiB"])
def test_a_second_agent_on_a_live_segment_refuses_in_one_line_and_changes_nothing(
    agent_process: AgentProcess, second: AgentProcess, l1_size: str
) -> None:
    agent_process.generate_tokens = second.generate_tokens = True
    agent_process.settings["L1_SIZE"] = "4MiB"
    first = agent_process.start()
    client = AgentClient(first.zmq, token=first.admin_token)
    client.connect()
    store(first, client, range(CHUNKS))
    before = everything(first)
    assert {*TOKEN_FILES} <= set(before["state"])  # type: ignore[arg-type]

    second.settings.update({"L1_SIZE": l1_size, "HANDOVER_SECONDS": "0"})
    second.launch()
    assert second.wait_refused() == 1
    lines = [line.rstrip("\n") for line in second.log if line.strip()]
    assert len(lines) == 1, second.log
    (refusal,) = lines
    assert refusal.startswith(f"kvpool-agent: segment {first.segment_path} is in use by ")
    assert f"pid {first.pid} " in refusal
    assert everything(first) == before
    # the first agent's clients go on: what was stored reads back, new stores work
    assert client.retrieve(TENANT, [key(n) for n in range(CHUNKS)]) == [
        payload(n) for n in range(CHUNKS)
    ]
    store(first, client, range(CHUNKS, CHUNKS + 4))
    assert first.segment_path.read_bytes()[:8] == b"KVPOOLS1"
    client.close()


def _refusal(agent: AgentProcess) -> str:
    """The one line of an agent that did not start, after it waited for the live one."""
    *waited, refusal = [line.rstrip("\n") for line in agent.log if line.strip()]
    assert len(waited) == 1 and "waiting up to 0.5 s (handover_seconds)" in waited[0], agent.log
    assert refusal.startswith("kvpool-agent: "), agent.log
    return refusal


def _answers(agent: AgentProcess) -> None:
    """The agent still serves its clients, and its admin token is still its own."""
    with AgentClient(agent.zmq, token=agent.admin_token) as client:
        store(agent, client, range(CHUNKS, CHUNKS + 2))
    response = httpx.get(
        f"{agent.http}/v1/tenants/{TENANT}/quota",
        headers={"Authorization": f"Bearer {agent.admin_token}"},
        timeout=5,
    )
    assert response.status_code == 200, response.text


@pytest.fixture
def beside(agent_process: AgentProcess) -> Iterator[AgentProcess]:
    """Another agent process with a segment of its own, in the first's work directory."""
    process = AgentProcess(agent_process.workdir, generate_tokens=True)
    segment = agent_process.segment_path.with_name(agent_process.segment_path.name + "-b")
    process.settings.update({"SEGMENT_PATH": str(segment), "HANDOVER_SECONDS": "0.5"})
    yield process
    process.kill()
    for end in ("", ".probe", ".lock"):
        segment.with_name(segment.name + end).unlink(missing_ok=True)


def test_a_second_agent_of_the_pool_on_the_same_state_directory_refuses(
    agent_process: AgentProcess, beside: AgentProcess
) -> None:
    """Its own segment, the first's state directory and pool: the first's tokens are kept."""
    agent_process.generate_tokens = True
    first = agent_process.start()
    with AgentClient(first.zmq, token=first.admin_token) as client:
        store(first, client, range(CHUNKS))
    before = everything(first)
    assert {*TOKEN_FILES} <= set(before["state"])  # type: ignore[arg-type]

    beside.launch()
    assert beside.wait_refused() == 1
    refusal = _refusal(beside)
    state = first.workdir / "state"
    assert refusal.startswith(
        f"kvpool-agent: state directory {state} (pool default) is in use by agent pid {first.pid} "
    ), refusal
    assert f"(lock {state / 'agent-default.lock'}; waited " in refusal
    assert refusal.endswith("give this one another pool or state_dir")
    assert everything(first) == before
    segment = Path(beside.settings["SEGMENT_PATH"])
    assert [p for p in Path("/dev/shm").iterdir() if p.name.startswith(segment.name)] == []
    _answers(first)


def test_a_second_agent_of_the_pool_on_the_same_nvme_tree_refuses(
    agent_process: AgentProcess, tmp_path: Path
) -> None:
    """Its own segment and state directory, the first's NVMe directory and pool."""
    nvme = json.dumps({"path": str(tmp_path / "nvme"), "capacity": "16MiB"})
    agent_process.settings.update({"NVME": nvme, "L1_SIZE": "4MiB"})
    first = agent_process.start()
    with AgentClient(first.zmq, token=first.admin_token) as client:
        store(first, client, range(CHUNKS))
    deadline = time.monotonic() + 20
    while len(list((tmp_path / "nvme").rglob("[0-9a-f]" * 64))) < CHUNKS:  # written back
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = listing(tmp_path / "nvme")
    other = AgentProcess(tmp_path / "other", {"NVME": nvme, "HANDOVER_SECONDS": "0.5"})
    other.workdir.mkdir()
    try:
        other.launch()
        assert other.wait_refused() == 1
        refusal = _refusal(other)
        assert refusal.startswith(
            f"kvpool-agent: NVMe tier {tmp_path / 'nvme' / 'default'} is in use by agent "
            f"pid {first.pid} "
        ), refusal
        assert refusal.endswith("give this one another pool or nvme.path")
        assert listing(tmp_path / "nvme") == before
        assert shm_names(other) == []
        assert sorted(p.name for p in other.workdir.iterdir()) == ["tokens.yaml"]
    finally:
        other.cleanup()
    _answers(first)


def test_a_rollout_hands_the_segment_over_once_the_old_agent_exits(
    agent_process: AgentProcess, second: AgentProcess
) -> None:
    old = agent_process.start()
    old.fix_ports()
    with AgentClient(old.zmq, token=old.admin_token) as client:
        store(old, client, range(CHUNKS))
    # the new pod starts while the old one still runs: it waits, on the same ports
    second.settings.update(old.settings)
    second.launch()
    deadline = time.monotonic() + 20
    while not any("waiting up to 30 s" in line for line in second.log):
        assert time.monotonic() < deadline, second.log
        time.sleep(0.05)
    assert f"is in use by agent pid {old.pid} " in "".join(second.log)
    with AgentClient(old.zmq, token=old.admin_token) as client:  # the old one still serves
        assert client.lookup(TENANT, [key(n) for n in range(CHUNKS)], lock=False).count == CHUNKS

    assert old.stop() == 0  # SIGTERM: it drains, then lets the lock go
    new = second.wait_ready()
    log = "".join(new.log)
    assert f"adopted segment {old.segment_path}: {CHUNKS} chunks restored" in log
    assert new.zmq == old.zmq
    with AgentClient(new.zmq, token=new.admin_token) as client:
        assert client.retrieve(TENANT, [key(n) for n in range(CHUNKS)]) == [
            payload(n) for n in range(CHUNKS)
        ]
    assert new.stop() == 0


CONFIGURATION, REFUSED = 2, 1
"""The agent's exit status for a mistake in its settings, and for a refused file."""


def _port_in_use(agent: AgentProcess, listener: socket.socket) -> tuple[str, int]:
    port = listener.getsockname()[1]
    agent.settings["HTTP_PORT"] = str(port)
    return f"port {port} (http_port) is in use on 127.0.0.1", CONFIGURATION


def _events_port_in_use(agent: AgentProcess, listener: socket.socket) -> tuple[str, int]:
    port = listener.getsockname()[1]
    agent.settings["EVENTS_PORT"] = str(port)
    return f"port {port} (events_port) is in use on 127.0.0.1", CONFIGURATION


def _bad_nvme_path(agent: AgentProcess, listener: socket.socket) -> tuple[str, int]:
    path = agent.workdir / "not-a-directory"
    path.write_text("a file")
    agent.settings["NVME"] = json.dumps({"path": str(path), "capacity": "16MiB"})
    return f"refusing NVMe tier directory {path}: it is a regular file, not a directory", REFUSED


def _probe_table_refused(agent: AgentProcess, listener: socket.socket) -> tuple[str, int]:
    """Refused after the segment exists: a directory where the probe table goes."""
    table = agent.files[1]
    table.mkdir()
    agent.settings["NVME"] = json.dumps({"path": str(agent.workdir / "nvme"), "capacity": "16MiB"})
    return f"refusing probe table {table}: it is a directory", REFUSED


def _bad_quota_file(agent: AgentProcess, listener: socket.socket) -> tuple[str, int]:
    path = agent.workdir / "quotas.json"
    path.write_text("{bad")
    path.chmod(0o600)
    agent.settings["QUOTA_FILE"] = str(path)
    return f"cannot read quotas from {path}: ", REFUSED


def _quota_configmap_unreachable(agent: AgentProcess, listener: socket.socket) -> tuple[str, int]:
    agent.settings["QUOTA_CONFIGMAP"] = "kvpool/quotas"  # and no kubeconfig (see the test)
    return "no access to the Kubernetes API for ConfigMap kvpool/quotas", REFUSED


def _tenants_configmap_unreachable(agent: AgentProcess, listener: socket.socket) -> tuple[str, int]:
    agent.settings["TENANTS_CONFIGMAP"] = "kvpool/tenants"
    return "no access to the Kubernetes API for ConfigMap kvpool/tenants", REFUSED


Failure = Callable[[AgentProcess, socket.socket], tuple[str, int]]
"""Sets up a start that fails; what its one line says, and the exit status."""
FAILURES: list[Failure] = [
    _port_in_use,
    _events_port_in_use,
    _bad_nvme_path,
    _probe_table_refused,
    _bad_quota_file,
    _quota_configmap_unreachable,
    _tenants_configmap_unreachable,
]
FAILURE_SETTINGS = (
    *("HTTP_PORT", "EVENTS_PORT", "NVME"),
    *("QUOTA_FILE", "QUOTA_CONFIGMAP", "TENANTS_CONFIGMAP"),
)


def snapshot(agent: AgentProcess) -> dict[str, object]:
    """Every file of the agent's in /dev/shm and under its work directory."""
    shm = Path("/dev/shm")
    return {  # the chunk files and the door are directories: what is in them too
        "shm": {name: (fingerprint(shm / name), listing(shm / name)) for name in shm_names(agent)},
        "work": listing(agent.workdir),
    }


@pytest.mark.parametrize(
    "earlier_segment", [None, "4MiB", "8MiB"], ids=["fresh", "warm", "warm-other-size"]
)
@pytest.mark.parametrize("failure", FAILURES, ids=lambda f: f.__name__.strip("_"))
def test_a_failed_start_leaves_no_file_it_made(
    agent_process: AgentProcess,
    failure: Failure,
    earlier_segment: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``earlier_segment``: the L1 size of an earlier agent's segment, left for a warm restart
    (the failed start's is 4MiB): even one that the start would replace stays as it was."""
    agent = agent_process
    monkeypatch.setenv("KUBECONFIG", str(agent.workdir / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    agent.generate_tokens = True
    if earlier_segment is not None:
        agent.settings["L1_SIZE"] = earlier_segment
        agent.start()
        with AgentClient(agent.zmq, token=agent.admin_token) as client:
            store(agent, client, range(CHUNKS))
        assert agent.stop() == 0
    agent.settings["L1_SIZE"] = "4MiB"
    with socket.create_server(("127.0.0.1", 0)) as listener:
        expected, status = failure(agent, listener)
        agent.process_environment()  # the harness writes its tokens file at launch
        before = snapshot(agent)
        agent.launch()
        assert agent.wait_refused() == status
    assert snapshot(agent) == before
    (refusal,) = [line for line in agent.log if line.startswith("kvpool-agent:")]
    assert expected in refusal
    assert "Traceback" not in "".join(agent.log)
    if agent.files[1].is_dir():
        agent.files[1].rmdir()
    if earlier_segment is not None:  # and the segment left for a warm restart still serves
        for setting in FAILURE_SETTINGS:
            agent.settings.pop(setting, None)
        agent.settings["L1_SIZE"] = earlier_segment
        agent.start()
        assert f"{CHUNKS} chunks restored" in "".join(agent.log)
        with AgentClient(agent.zmq, token=agent.admin_token) as client:
            assert client.retrieve(TENANT, [key(n) for n in range(CHUNKS)]) == [
                payload(n) for n in range(CHUNKS)
            ]


def test_cleanup_removes_every_file_of_a_killed_agent(agent_process: AgentProcess) -> None:
    agent_process.start()
    segment, table = agent_process.files[:2]
    assert segment.exists() and table.exists()
    agent_process.kill()  # SIGKILL: the agent removes nothing
    agent_process.cleanup()
    assert shm_names(agent_process) == []
