"""One agent owns a segment (issue 28): real agents, started side by side.

A second agent for a live segment refuses to start in one line naming the segment and the
live agent, and changes nothing of the first's (its segment, token files, probe table,
lock, clients), whether its L1 size is the same or another. A rollout's new agent waits
for the old one to exit, then adopts the segment with every chunk. A start that fails
leaves no file it made, and never removes a segment an earlier agent left.
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

import pytest

from kvpool_agent.client import AgentClient
from kvpool_agent.keys import tenant_id
from kvpool_agent.testing.agent_process import AgentProcess
from tests.support.chunks import key

TENANT = tenant_id("owner-a")
CHUNKS = 16
SIZE = 10_000
TOKEN_FILES = ("admin-token-default", "engine-token-default", "index-token-default")


def payload(name: int) -> bytes:
    return random.Random(name).randbytes(SIZE)


def fingerprint(path: Path) -> tuple[int, int, str] | None:
    """Inode, size and content digest of a file ("directory" for one); None if there is none."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    if path.is_dir():
        return status.st_ino, 0, "directory"
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
    return {
        "shm": {name: fingerprint(Path("/dev/shm") / name) for name in shm_names(agent)},
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
    assert client.segment().read(0, 8) == b"KVPOOLS1"
    client.close()


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


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _pinning_without_cuda(agent: AgentProcess, listener: socket.socket) -> tuple[str, int]:
    """Refused once the segment and the probe table exist (and the L2 key, and the cache)."""
    if _cuda_available():
        pytest.skip("a CUDA device pins the segment")
    agent.settings["PIN_MEMORY"] = "always"
    agent.settings["NVME"] = json.dumps({"path": str(agent.workdir / "nvme"), "capacity": "16MiB"})
    return f"cannot pin segment {agent.segment_path}: pin_memory=always but", REFUSED


Failure = Callable[[AgentProcess, socket.socket], tuple[str, int]]
"""Sets up a start that fails; what its one line says, and the exit status."""
FAILURES: list[Failure] = [
    _port_in_use,
    _events_port_in_use,
    _bad_nvme_path,
    _probe_table_refused,
    _pinning_without_cuda,
]


def snapshot(agent: AgentProcess) -> dict[str, object]:
    """Every file of the agent's in /dev/shm and under its work directory."""
    return {
        "shm": {name: fingerprint(Path("/dev/shm") / name) for name in shm_names(agent)},
        "work": listing(agent.workdir),
    }


@pytest.mark.parametrize("earlier_segment", [False, True], ids=["fresh", "warm"])
@pytest.mark.parametrize("failure", FAILURES, ids=lambda f: f.__name__.strip("_"))
def test_a_failed_start_leaves_no_file_it_made(
    agent_process: AgentProcess, failure: Failure, earlier_segment: bool
) -> None:
    agent = agent_process
    agent.generate_tokens = True
    agent.settings["L1_SIZE"] = "4MiB"
    if earlier_segment:  # an earlier agent's segment, left for a warm restart
        agent.start()
        with AgentClient(agent.zmq, token=agent.admin_token) as client:
            store(agent, client, range(CHUNKS))
        assert agent.stop() == 0
    with socket.create_server(("127.0.0.1", 0)) as listener:
        expected, status = failure(agent, listener)
        agent.environment()  # the harness writes its tokens file at launch
        before = snapshot(agent)
        agent.launch()
        assert agent.wait_refused() == status
    assert snapshot(agent) == before
    (refusal,) = [line for line in agent.log if line.startswith("kvpool-agent:")]
    assert expected in refusal
    assert "Traceback" not in "".join(agent.log)
    if earlier_segment:  # and the segment left for a warm restart still serves its chunks
        for setting in ("HTTP_PORT", "EVENTS_PORT", "NVME", "PIN_MEMORY"):
            agent.settings.pop(setting, None)
        if agent.files[1].is_dir():
            agent.files[1].rmdir()
        agent.start()
        assert f"{CHUNKS} chunks restored" in "".join(agent.log)
        with AgentClient(agent.zmq, token=agent.admin_token) as client:
            assert client.retrieve(TENANT, [key(n) for n in range(CHUNKS)]) == [
                payload(n) for n in range(CHUNKS)
            ]
    elif agent.files[1].is_dir():
        agent.files[1].rmdir()


def test_cleanup_removes_every_file_of_a_killed_agent(agent_process: AgentProcess) -> None:
    agent_process.start()
    segment, table = agent_process.files[:2]
    assert segment.exists() and table.exists()
    agent_process.kill()  # SIGKILL: the agent removes nothing
    agent_process.cleanup()
    assert shm_names(agent_process) == []
