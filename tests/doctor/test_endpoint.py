"""``kvpool doctor --endpoint``: every agent-side check against a real agent process, and
each failure it names (wrong port, a door this pod does not reach, a door that gives no
chunk file, a mapping that holds other bytes, a protocol the agent refuses, a tenant that
never hits)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.client import AgentClient
from kvpool.common import protocol
from kvpool.common.door import ChunkFile, open_chunk_file
from kvpool.common.keys import CANARY_TENANT, tenant_id
from kvpool.common.segment import door_path
from kvpool.tools import cli
from kvpool.tools.doctor import canary, shared_memory
from tests.support.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, AgentProcess

from .conftest import ADMIN_ENV, Diagnosis, agent_args, parse, run_doctor

pytestmark = pytest.mark.process

TENANT = tenant_id("team-a-cache-salt")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def keys(name: str, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}-{index}".encode()).digest() for index in range(count)]


def usage(agent: AgentProcess) -> dict[str, dict[str, int]]:
    response = httpx.get(f"{agent.http}/v1/tenants", headers=ADMIN)
    response.raise_for_status()
    return {entry["tenant"]: entry for entry in response.json()["tenants"]}


def status(agent: AgentProcess) -> dict[str, Any]:
    response = httpx.get(f"{agent.http}/v1/status", headers=ADMIN)
    response.raise_for_status()
    return dict(response.json())


def agent_door(agent: AgentProcess) -> Path:
    """Where the agent serves its door (and its hello names it)."""
    return door_path(agent.segment_path)


_DOOR_METRIC = re.compile(r'^kvpool_door_(granted|refused)_total(?:\{reason="(\w+)"\})? (\S+)$')


def door_counts(agent: AgentProcess) -> dict[str, int]:
    """The agent's door so far: ``granted`` (chunk files handed out), ``refused`` (all
    refusals), and each refusal by its reason."""
    response = httpx.get(f"{agent.http}/metrics", headers=ADMIN)
    response.raise_for_status()
    counts = {"granted": 0, "refused": 0}
    for line in response.text.splitlines():
        match = _DOOR_METRIC.match(line)
        if match is None:
            continue
        kind, reason, value = match.groups()
        if kind == "granted":
            counts["granted"] = int(float(value))
        else:
            counts[reason] = int(float(value))
            counts["refused"] += int(float(value))
    return counts


def test_a_healthy_agent_passes_and_the_canary_leaves_nothing(agent: AgentProcess) -> None:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as tenant:  # a tenant that stores and hits
        tenant.store(TENANT, keys("a", 3), [b"x" * 4096] * 3)
        assert len(tenant.retrieve(TENANT, keys("a", 3))) == 3
    before, counts = usage(agent)[TENANT], door_counts(agent)

    diagnosis = run_doctor(
        *agent_args(agent),
        "--block-size",
        "128",
        env={**ADMIN_ENV, "KVPOOL_CONNECTOR_CHUNK_TOKENS": "256"},
    )

    assert diagnosis.returncode == 0, diagnosis.output
    assert diagnosis.outcomes() == {
        "service": "SKIP",
        "protocol": "SKIP",
        "annotations": "SKIP",
        "agent": "PASS",
        "door": "PASS",
        "transport": "PASS",
        "canary": "PASS",
        "chunk-size": "PASS",
        "fingerprint": "SKIP",  # no pool, no index
        "hit-rate": "PASS",
        "peers": "SKIP",  # an agent without peers
        "picker": "SKIP",  # no pool, no index
        "model": "SKIP",  # no --model-config
    }, diagnosis.output
    checks, door = diagnosis.checks, agent_door(agent)
    assert checks["agent"].seen.endswith(
        f", protocol {protocol.PROTOCOL_VERSION}, segment {agent.segment_path} "
        "(64.0 MiB of chunk data)"
    )
    assert checks["door"].seen == (
        f"{door}: the agent's door, which gives this pod's token its chunk files"
    )
    assert checks["transport"].seen == (
        f"chunk files from the agent's door {door}: KV is copied in this pod's memory"
    )
    assert checks["canary"].seen.endswith(
        "stored by the agent and read here, stored here and read by the agent, loaded back "
        f"through a chunk file from {door}; identical bytes; cleared, nothing left"
    )
    assert checks["chunk-size"].seen == "256-token chunks: 2 blocks of 128"
    assert checks["hit-rate"].seen.startswith("counted since the agent started: ")
    assert f"tenant {TENANT}: 3 of 3 chunk lookups hit (100%)" in checks["hit-rate"].seen
    assert CANARY_TENANT not in checks["hit-rate"].seen

    after = usage(agent)
    assert after[TENANT] == before  # the doctor changed nothing of a tenant's
    assert (after[CANARY_TENANT]["chunks"], after[CANARY_TENANT]["used_bytes"]) == (0, 0)
    agent_status = status(agent)
    assert (agent_status["chunks"], agent_status["open_leases"]) == (3, 0)
    # the canary's chunk file, handed out once by the door; nothing refused
    assert door_counts(agent) == {**counts, "granted": counts["granted"] + 1}
    assert counts["refused"] == 0


def test_a_second_run_passes_too(agent: AgentProcess) -> None:
    """The canary starts from a clean tenant and cleans up: runs do not disturb each other."""
    for _ in range(2):
        diagnosis = run_doctor(*agent_args(agent), env=ADMIN_ENV)
        assert diagnosis.checks["canary"].outcome == "PASS", diagnosis.output


@pytest.mark.parametrize("port", ["closed", "http"])
def test_wrong_port(agent: AgentProcess, port: str) -> None:
    if port == "http":  # the agent's HTTP port: something listens, not the kvpool protocol
        endpoint = agent.zmq.rsplit(":", 1)[0] + ":" + agent.http.rsplit(":", 1)[1]
        cause = "accepts connections but does not speak the kvpool protocol"
    else:
        endpoint, cause = "tcp://127.0.0.1:9", "nothing listens on 127.0.0.1:9 (connection refused)"

    diagnosis = run_doctor("--endpoint", endpoint, "--timeout", "1")

    assert diagnosis.returncode == 1
    failure = diagnosis.checks["agent"]
    assert failure.outcome == "FAIL"
    assert failure.seen.startswith(f"no answer from {endpoint} in 1 s: ")
    assert cause in failure.seen
    assert failure.fix is not None and "agent ready ... zmq=tcp://HOST:PORT" in failure.fix
    for name in ("door", "transport", "canary"):
        assert diagnosis.checks[name].outcome == "SKIP"
        assert diagnosis.checks[name].seen == "needs an agent that answers"


@pytest.mark.parametrize(
    "how",
    [
        "missing",
        "a directory",
        "a regular file",
        "beside another segment path",
        "behind a directory of another owner",
    ],
)
def test_a_door_this_pod_does_not_reach_warns_and_the_canary_takes_messages(
    agent: AgentProcess, tmp_path: Path, how: str
) -> None:
    """The connector maps no chunk file: the doctor says why and how to give the pod the
    door, and its canary takes the connector's fallback (the agent's messages)."""
    arguments, env = agent_args(agent), dict(ADMIN_ENV)
    door = tmp_path / "agent.sock"
    private = tmp_path / "private"
    if how == "missing":
        expected = f"{door}: No such file or directory in this pod"
    elif how == "a directory":
        door.mkdir()
        expected = f"{door} is not a socket (mode drwx"
    elif how == "a regular file":
        door.write_text("not a socket")
        expected = f"{door} is not a socket (mode -rw"
    elif how == "beside another segment path":  # the door is found beside the segment
        arguments += ["--segment-path", str(tmp_path / "segment")]
        door = door_path(tmp_path / "segment")
        expected = f"{door}: No such file or directory in this pod"
    else:
        # the agent's own door, through a directory this pod's uid may not search (not as
        # root here: the doctor runs without root's file capabilities)
        private.mkdir()
        door = private / "agent.sock"
        door.symlink_to(agent_door(agent))
        if os.geteuid() == 0:
            os.chown(private, 10001, 10001)
        private.chmod(0o700 if os.geteuid() == 0 else 0)
        expected = f"{door}: Permission denied in this pod"
    if how != "beside another segment path":
        env["KVPOOL_CONNECTOR_DOOR_PATH"] = str(door)
    granted = door_counts(agent)["granted"]
    try:
        diagnosis = run_doctor(*arguments, env=env, as_a_pod=True)
        if how == "behind a directory of another owner":
            # the same door, for a uid that may search the directory: it passes
            reached = run_doctor(*arguments, env=env)
            assert reached.outcomes()["door"] == "PASS", reached.output
            assert reached.outcomes()["canary"] == "PASS", reached.output
            assert door_counts(agent)["granted"] == granted + 1
            granted += 1
    finally:
        if private.exists():
            private.chmod(0o700)

    assert diagnosis.returncode == 0, diagnosis.output  # the connector works, slower
    warning = diagnosis.checks["door"]
    assert warning.outcome == "WARN", diagnosis.output
    assert warning.seen.startswith(expected), warning.seen
    assert warning.fix is not None
    assert warning.fix.startswith("label the pod for the pool (kvpool's admission webhook")
    assert "KVPOOL_CONNECTOR_DOOR_PATH" in warning.fix
    assert_through_messages(diagnosis)
    assert f"it does not reach {door} (the door line says why)" in (
        diagnosis.checks["transport"].seen
    )
    assert diagnosis.checks["agent"].outcome == "PASS"
    assert door_counts(agent)["granted"] == granted  # nothing was mapped


def assert_through_messages(diagnosis: Diagnosis) -> None:
    """The doctor reports the connector's fallback, and its canary takes that path."""
    assert diagnosis.checks["transport"].outcome == "PASS"
    assert diagnosis.checks["transport"].seen.startswith("the agent's messages over the network")
    canary_check = diagnosis.checks["canary"]
    assert canary_check.outcome == "PASS", diagnosis.output
    assert "stored through the agent's messages and read back the same way" in canary_check.seen


def test_a_pod_on_the_messages_transport_asks_no_door_and_passes(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """KVPOOL_CONNECTOR_TRANSPORT=messages, a pod that maps nothing: the door is not looked at (not
    even one its settings name), and the path the connector takes is checked."""
    granted = door_counts(agent)["granted"]
    env = {
        "KVPOOL_CONNECTOR_TRANSPORT": "messages",
        "KVPOOL_CONNECTOR_DOOR_PATH": str(tmp_path / "absent.sock"),
    }

    diagnosis = run_doctor(*agent_args(agent), env=env)

    assert diagnosis.returncode == 0, diagnosis.output
    door = diagnosis.checks["door"]
    assert (door.outcome, door.seen) == (
        "PASS",
        "not used (transport=messages): this pod maps no chunk file",
    ), diagnosis.output
    assert "it maps no chunk file (the door line says why)" in diagnosis.checks["transport"].seen
    assert_through_messages(diagnosis)
    assert door_counts(agent)["granted"] == granted


def test_a_tenants_token_maps_the_canarys_chunk_file_through_its_door(tmp_path: Path) -> None:
    """A team's engine holds its tenant's token: the door gives it the canary tenant's
    chunk file too, so its canary runs through the mapped file, as its connector would."""
    token = "tenant-a-token-for-tests-8b5d03f7a2c961e4"
    agent = AgentProcess(tmp_path, tenant_tokens={TENANT: token}).start()
    try:
        counts = door_counts(agent)
        diagnosis = run_doctor(*agent_args(agent), env={"KVPOOL_CONNECTOR_TOKEN": token})
        after = door_counts(agent)
        tenants = usage(agent)
    finally:
        agent.cleanup()

    assert diagnosis.returncode == 0, diagnosis.output
    door = agent_door(agent)
    checks = diagnosis.checks
    assert checks["agent"].outcome == "PASS", diagnosis.output
    assert (checks["door"].outcome, checks["door"].seen) == (
        "PASS",
        f"{door}: the agent's door, which gives this pod's token its chunk files",
    )
    assert checks["transport"].seen.startswith(f"chunk files from the agent's door {door}: ")
    assert checks["canary"].outcome == "PASS", diagnosis.output
    assert checks["canary"].seen.endswith(
        f"loaded back through a chunk file from {door}; identical bytes; cleared, nothing left"
    )
    assert after["granted"] == counts["granted"] + 1  # the canary's file, mapped once
    assert after["refused"] == counts["refused"] == 0
    assert (tenants[CANARY_TENANT]["chunks"], tenants[CANARY_TENANT]["used_bytes"]) == (0, 0)
    assert tenants.get(TENANT, {}).get("chunks", 0) == 0  # nothing of the tenant's own


def test_a_pod_without_the_nodes_shm_warns_and_the_canary_takes_messages(
    agent: AgentProcess,
) -> None:
    """The classic: the pod's /dev/shm is its own small tmpfs, and it was not given the
    agent's door: the door the agent's hello names is not there."""
    diagnosis = run_doctor(*agent_args(agent), own_shm_mib=16)

    assert diagnosis.returncode == 0, diagnosis.output
    missing = diagnosis.checks["door"]
    assert missing.outcome == "WARN", diagnosis.output
    assert missing.seen == f"{agent_door(agent)}: No such file or directory in this pod"
    assert missing.fix is not None and missing.fix.startswith("label the pod for the pool")
    assert_through_messages(diagnosis)


def test_a_door_nobody_answers_at_warns_and_the_canary_takes_messages(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """A socket file that nobody listens on (an agent that stopped left it): the door check
    connects, and warns with the fix; the canary goes through the agent's messages."""
    door = tmp_path / "agent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(door))
    diagnosis = run_doctor(
        *agent_args(agent), env={**ADMIN_ENV, "KVPOOL_CONNECTOR_DOOR_PATH": str(door)}
    )

    assert diagnosis.returncode == 0, diagnosis.output
    warning = diagnosis.checks["door"]
    assert warning.outcome == "WARN", diagnosis.output
    assert warning.seen == f"{door}: nobody answers there (Connection refused)"
    assert warning.fix is not None and warning.fix.startswith("the agent that left it")
    assert_through_messages(diagnosis)


@pytest.mark.parametrize(
    "how", ["another agent's, named by door_path", "another agent's at this one's"]
)
def test_a_door_that_gives_no_chunk_file_fails_the_canary_in_one_line(
    agent: AgentProcess, tmp_path: Path, how: str
) -> None:
    """The door is a socket someone answers at, so the pod asks it; but it is another
    agent's (named by KVPOOL_CONNECTOR_DOOR_PATH, or moved over this agent's own, as a second
    agent at the same path would), which has no such file. The canary says so in one line,
    without a traceback, and leaves its tenant cleared."""
    other = AgentProcess(tmp_path / "other")
    other.workdir.mkdir()
    env = dict(ADMIN_ENV)
    try:
        other.start()
        if how == "another agent's, named by door_path":
            door = agent_door(other)
            env["KVPOOL_CONNECTOR_DOOR_PATH"] = str(door)
        else:
            door = agent_door(agent)
            os.replace(agent_door(other), door)
        refused = f"the agent's door {door} refused file "
        diagnosis = run_doctor(*agent_args(agent), env=env)
        others = door_counts(other)
    finally:
        other.cleanup()

    assert diagnosis.returncode == 1, diagnosis.output
    assert "Traceback" not in diagnosis.output + diagnosis.stderr, diagnosis.stderr
    assert diagnosis.checks["door"].outcome == "PASS", diagnosis.output
    assert diagnosis.checks["transport"].seen.startswith(
        f"chunk files from the agent's door {door}"
    )
    failure = diagnosis.checks["canary"]
    assert failure.outcome == "FAIL", diagnosis.output
    assert failure.seen.startswith(f"this pod cannot map the canary's chunk file: {refused}")
    assert failure.fix == shared_memory.OTHER_FILE
    assert [line for line in diagnosis.output.splitlines() if "canary" in line] == [
        f"FAIL  canary       {failure.seen}"
    ]  # one line (and its fix): the rest of the checks still ran
    assert diagnosis.checks["hit-rate"].outcome == "PASS", diagnosis.output
    # the other agent has no such file, and said so
    assert (others["unknown_file"], others["granted"]) == (1, 0), others
    tenants = usage(agent)
    assert (tenants[CANARY_TENANT]["chunks"], tenants[CANARY_TENANT]["used_bytes"]) == (0, 0)
    assert status(agent)["open_leases"] == 0


@pytest.mark.parametrize("mapping", ["an empty file", "a copy of the file"])
def test_the_canary_tells_a_mapping_that_holds_other_bytes(
    agent: AgentProcess, monkeypatch: pytest.MonkeyPatch, mapping: str
) -> None:
    """This pod's mapping of the canary's chunk file is not the file the agent writes (here,
    a file of the same size in its place): the canary compares the bytes both ways."""
    replaced: list[int] = []

    def another_file(door: Path, token: str, file_id: int, timeout: float) -> ChunkFile:
        real = open_chunk_file(door, token, file_id, timeout)
        try:
            size = os.fstat(real.fd).st_size
            other = os.memfd_create("kvpool-doctor-test")
            os.ftruncate(other, size)
            if mapping == "a copy of the file":  # what the agent wrote so far, then apart
                os.pwrite(other, os.pread(real.fd, size, 0), 0)
        finally:
            real.close()
        replaced.append(file_id)
        return ChunkFile(other, real.owner, real.writable, file_id)

    # where the client's chunk files ask the door
    monkeypatch.setattr("kvpool.client.mapped_files.open_chunk_file", another_file)
    with AgentClient(agent.zmq, token=ENGINE_TOKEN, door_path=agent_door(agent)) as client:
        check = canary.check_canary(client)

    assert len(replaced) == 1, replaced
    assert check.outcome == "FAIL", check
    if mapping == "an empty file":
        assert check.seen.startswith("canary mismatch: the agent wrote the canary at offset ")
        assert check.seen.endswith(
            f" of its chunk file {replaced[0]}; this pod's mapping of it holds other bytes there"
        )
    else:
        assert check.seen.startswith("canary mismatch: this pod stored the canary at offset ")
        assert check.seen.endswith("it loaded the same bytes back, the agent read other bytes")
    assert check.fix == shared_memory.OTHER_FILE
    assert usage(agent)[CANARY_TENANT]["chunks"] == 0  # cleared all the same
    assert status(agent)["open_leases"] == 0


def test_an_agent_that_refuses_the_protocol(
    agent: AgentProcess, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client of another protocol version: the real agent answers unsupported_version."""
    monkeypatch.setattr(protocol, "PROTOCOL_VERSION", protocol.PROTOCOL_VERSION + 1)
    monkeypatch.setenv("KVPOOL_CONNECTOR_TOKEN", ENGINE_TOKEN)

    returncode = cli.main(["doctor", "--endpoint", agent.zmq])

    checks = parse(capsys.readouterr().out)
    assert returncode == 1
    failure = checks["agent"]
    assert failure.outcome == "FAIL"
    assert failure.seen.startswith(f"protocol mismatch: the agent at {agent.zmq} refuses")
    assert "unsupported_version" in failure.seen
    assert failure.fix is not None and "one kvpool release" in failure.fix


def test_a_tenant_that_never_hits_is_flagged(agent: AgentProcess) -> None:
    starved, served = tenant_id("starved"), tenant_id("served")
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as engine:
        engine.store(starved, keys("stored", 2), [b"y" * 4096] * 2)
        for round_ in range(60):  # looks up chunks it never stored
            engine.lookup(starved, keys(f"other-{round_}", 2), lock=False)
        engine.store(served, keys("b", 1), [b"z" * 4096])
        engine.lookup(served, keys("b", 1) + keys("missing", 200), lock=False)

    diagnosis = run_doctor(*agent_args(agent), "--min-lookups", "100", env=ADMIN_ENV)

    assert diagnosis.returncode == 1
    failure = diagnosis.checks["hit-rate"]
    assert failure.outcome == "FAIL", diagnosis.output
    assert failure.seen == (
        f"counted since the agent started: tenant {starved}: 0 of 120 chunk lookups hit "
        "(0%), 2 stored, 0 evicted, never a hit"
    )
    assert failure.fix is not None and "cache_salt" in failure.fix


def test_the_hit_rate_needs_an_admin_token(agent: AgentProcess) -> None:
    without = run_doctor(*agent_args(agent))
    assert without.checks["hit-rate"].outcome == "SKIP"
    wrong = run_doctor(*agent_args(agent), env={"KVPOOL_ADMIN_TOKEN": "not-a-token"})
    assert wrong.returncode == 1
    assert wrong.checks["hit-rate"].seen.endswith("401: the agent refused the token")


def test_the_canary_never_reaches_l2(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    agent = AgentProcess(
        tmp_path / "agent", settings={"NVME": json.dumps({"path": str(nvme), "capacity": "64MiB"})}
    )
    agent.workdir.mkdir()
    agent.start()
    try:
        assert run_doctor(*agent_args(agent), env=ADMIN_ENV).outcomes()["canary"] == "PASS"
        # a tenant's chunk stored after the canary is written back, so the write-back queue
        # (first in, first out) is past anything the canary could have put there
        with AgentClient(agent.zmq, token=ADMIN_TOKEN) as tenant:
            tenant.store(TENANT, keys("l2", 1), [b"y" * 4096])
        deadline = time.monotonic() + 20
        while not list((nvme / "default" / TENANT).rglob("[0-9a-f]" * 64)):
            assert time.monotonic() < deadline, "the agent wrote nothing back to L2"
            time.sleep(0.1)
    finally:
        agent.cleanup()

    assert not (nvme / "default" / CANARY_TENANT).exists()


def test_chunks_of_partial_blocks_are_named(agent: AgentProcess) -> None:
    diagnosis = run_doctor(
        *agent_args(agent), "--block-size", "96", env={"KVPOOL_CONNECTOR_CHUNK_TOKENS": "256"}
    )

    assert diagnosis.returncode == 1
    assert diagnosis.checks["chunk-size"].outcome == "FAIL", diagnosis.output
    assert "96" in diagnosis.checks["chunk-size"].seen


def test_a_missing_or_refused_token_is_one_fail_line_with_the_fix(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """As the connector: no token anywhere, then a token the agent does not know."""
    for env, seen in (
        (
            {"KVPOOL_CONNECTOR_TOKEN": "", "HOME": str(tmp_path)},
            "no token for the kvpool agent: set",
        ),
        (
            {"KVPOOL_CONNECTOR_TOKEN": "not-a-token-of-this-pool"},
            f"the agent at {agent.zmq} refused",
        ),
    ):
        diagnosis = run_doctor(*agent_args(agent), env=env)
        assert diagnosis.returncode == 1
        failure = diagnosis.checks["agent"]
        assert failure.outcome == "FAIL" and failure.seen.startswith(seen), failure
        assert failure.fix is not None and "KVCacheTenant's Secret" in failure.fix
        assert diagnosis.checks["canary"].outcome == "SKIP"
