"""``kvpool doctor --endpoint``: every agent-side check against a real agent process, and
each failure it names (wrong port, unreadable segment, another file mapped, a protocol the
agent refuses, a tenant that never hits)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from kvpool_agent import cli, protocol
from kvpool_agent.client import AgentClient
from kvpool_agent.doctor import canary
from kvpool_agent.keys import CANARY_TENANT, tenant_id
from kvpool_agent.segment import SharedSegment
from kvpool_agent.testing.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, AgentProcess

from .conftest import ADMIN_ENV, Diagnosis, agent_args, parse, run_doctor

TENANT = tenant_id("team-a-cache-salt")
AGENT_SIDE = ("agent", "segment", "shm", "canary")


def keys(name: str, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}-{index}".encode()).digest() for index in range(count)]


def usage(agent: AgentProcess) -> dict[str, dict[str, int]]:
    response = httpx.get(
        f"{agent.http}/v1/tenants", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    response.raise_for_status()
    return {entry["tenant"]: entry for entry in response.json()["tenants"]}


def test_a_healthy_agent_passes_and_the_canary_leaves_nothing(agent: AgentProcess) -> None:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as tenant:  # a tenant that stores and hits
        tenant.store(TENANT, keys("a", 3), [b"x" * 4096] * 3)
        assert len(tenant.retrieve(TENANT, keys("a", 3))) == 3
    before = usage(agent)[TENANT]

    diagnosis = run_doctor(
        *agent_args(agent), "--block-size", "128", env={**ADMIN_ENV, "KVPOOL_CHUNK_TOKENS": "256"}
    )

    assert diagnosis.returncode == 0, diagnosis.output
    assert diagnosis.outcomes() == {
        "service": "SKIP",
        "protocol": "SKIP",
        "annotations": "SKIP",
        "agent": "PASS",
        "segment": "PASS",
        "shm": "PASS",
        "transport": "PASS",
        "canary": "PASS",
        "chunk-size": "PASS",
        "fingerprint": "SKIP",  # no pool, no index
        "hit-rate": "PASS",
        "peers": "SKIP",  # an agent without peers
        "model": "SKIP",  # no --model-config
    }, diagnosis.output
    checks = diagnosis.checks
    assert f"segment {agent.segment_path}" in checks["agent"].seen
    assert f"{agent.segment_path}: 64.2 MiB, the agent's size" in checks["segment"].seen
    assert "the segment takes 64.2 MiB (l1_size 64.0 MiB" in checks["shm"].seen
    assert checks["transport"].seen.startswith(f"the shared segment {agent.segment_path}: ")
    assert "identical bytes; cleared, nothing left" in checks["canary"].seen
    assert checks["chunk-size"].seen == "256-token chunks: 2 blocks of 128"
    assert checks["hit-rate"].seen.startswith("counted since the agent started: ")
    assert f"tenant {TENANT}: 3 of 3 chunk lookups hit (100%)" in checks["hit-rate"].seen
    assert CANARY_TENANT not in checks["hit-rate"].seen

    after = usage(agent)
    assert after[TENANT] == before  # the doctor changed nothing of a tenant's
    assert (after[CANARY_TENANT]["chunks"], after[CANARY_TENANT]["used_bytes"]) == (0, 0)
    status = httpx.get(
        f"{agent.http}/v1/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ).json()
    assert (status["chunks"], status["open_leases"]) == (3, 0)


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
    for name in ("segment", "shm", "transport", "canary"):
        assert diagnosis.checks[name].outcome == "SKIP"
        assert diagnosis.checks[name].seen == "needs an agent that answers"


@pytest.mark.parametrize("how", ["another owner", "a directory", "a file of another size"])
def test_unreadable_segment(agent: AgentProcess, tmp_path: Path, how: str) -> None:
    """The connector's mapping fails: the doctor says why, and never runs the canary."""
    arguments = agent_args(agent)
    segment = agent.segment_path
    if how == "another owner":
        # The image's agent runs as uid 10001 and its segment is rw for owner and group; a
        # vLLM container of another uid cannot open it read-write. (Not as root here: the
        # doctor runs without root's file capabilities.)
        if os.geteuid() == 0:
            os.chown(segment, 10001, 10001)
        segment.chmod(0o600 if os.geteuid() == 0 else 0)
        expected = f"uid {os.geteuid()} cannot map {segment} read-write: "
        expected += f"cannot open segment {segment}: Permission denied"
    elif how == "a directory":
        segment = tmp_path / "shm"
        segment.mkdir()
        arguments += ["--segment-path", str(segment)]
        expected = f"{segment} is not a file (mode d"
    else:
        segment = Path("/dev/shm") / f"kvpool-doctor-short-{os.getpid()}"
        segment.write_bytes(b"\0" * 4096)
        arguments += ["--segment-path", str(segment)]
        expected = f"{segment} has 4096 bytes; the agent's segment ({agent.segment_path}) has "
    try:
        diagnosis = run_doctor(*arguments, as_a_pod=True)
    finally:
        if how == "a file of another size":
            segment.unlink()

    assert diagnosis.returncode == 0, diagnosis.output  # the connector works, slower
    failure = diagnosis.checks["segment"]
    assert failure.outcome == "WARN", diagnosis.output
    assert failure.seen.startswith(expected), failure.seen
    assert failure.fix is not None
    if how == "another owner":
        owner = segment.stat().st_uid
        assert failure.fix.startswith(f"run vLLM as uid {owner} (securityContext.runAsUser)")
    else:
        assert "mount the node's /dev/shm into the vLLM pod" in failure.fix
    assert_through_messages(diagnosis)
    assert diagnosis.checks["agent"].outcome == "PASS"


def assert_through_messages(diagnosis: Diagnosis) -> None:
    """The doctor reports the connector's fallback, and its canary takes that path."""
    assert diagnosis.checks["transport"].outcome == "PASS"
    assert diagnosis.checks["transport"].seen.startswith("the agent's messages over the network")
    canary_check = diagnosis.checks["canary"]
    assert canary_check.outcome == "PASS", diagnosis.output
    assert "stored through the agent's messages and read back the same way" in canary_check.seen


def test_a_tenants_pod_maps_nothing_and_passes(agent: AgentProcess) -> None:
    """KVPOOL_TRANSPORT=messages, a pod that maps no segment: the segment, which this
    process could map, is not looked at, and the path the connector takes is checked."""
    diagnosis = run_doctor(*agent_args(agent), env={"KVPOOL_TRANSPORT": "messages"})

    assert diagnosis.returncode == 0, diagnosis.output
    segment = diagnosis.checks["segment"]
    assert segment.outcome == "PASS", diagnosis.output
    assert segment.seen.startswith("not mapped here (transport=messages)")
    assert diagnosis.checks["shm"].outcome == "SKIP"
    assert "it maps no segment" in diagnosis.checks["transport"].seen
    assert_through_messages(diagnosis)


def test_a_pod_without_the_nodes_shm(agent: AgentProcess) -> None:
    """The classic: the pod's /dev/shm is its own small tmpfs, not the node's."""
    diagnosis = run_doctor(*agent_args(agent), own_shm_mib=16)

    assert diagnosis.returncode == 0, diagnosis.output
    missing = diagnosis.checks["segment"]
    assert missing.outcome == "WARN", diagnosis.output
    assert missing.seen == f"{agent.segment_path}: No such file or directory in this pod"
    assert missing.fix is not None and "hostPath" in missing.fix
    assert_through_messages(diagnosis)
    small = diagnosis.checks["shm"]
    assert small.outcome == "WARN"
    assert small.seen.startswith("/dev/shm: 16.0 MiB in all, 16.0 MiB free; the segment takes")
    assert small.fix is not None and "is not the node's /dev/shm" in small.fix


def test_a_pod_that_maps_another_file_fails_the_segment_check_naming_both(
    agent: AgentProcess,
) -> None:
    """A copy of the agent's segment (its size, its layout, its bytes): the agent's hello
    names the file it maps, and this one is another."""
    copy = Path("/dev/shm") / f"kvpool-doctor-copy-{os.getpid()}"
    shutil.copyfile(agent.segment_path, copy)
    original = hashlib.sha256(copy.read_bytes()).digest()
    try:
        diagnosis = run_doctor(*agent_args(agent), "--segment-path", str(copy), env=ADMIN_ENV)
        assert hashlib.sha256(copy.read_bytes()).digest() == original  # never written
    finally:
        copy.unlink()

    assert diagnosis.returncode == 0, diagnosis.output
    failure = diagnosis.checks["segment"]
    assert failure.outcome == "WARN", diagnosis.output
    assert failure.seen.startswith(f"this pod maps {copy} (file ")
    assert f"the agent maps its segment {agent.segment_path} (file " in failure.seen
    assert failure.seen.endswith("they are different files")
    assert failure.fix is not None and "--segment-path" in failure.fix
    assert_through_messages(diagnosis)


def test_a_segment_replaced_under_its_live_agent_fails_naming_both(agent: AgentProcess) -> None:
    """Another file at the agent's very path (what a second agent did before issue 28): the
    pod maps it, the agent its own; the agent says so in its log too."""
    path = agent.segment_path
    replacement = path.with_name(f".{path.name}.replacement")
    shutil.copyfile(path, replacement)
    os.replace(replacement, path)

    diagnosis = run_doctor(*agent_args(agent), env=ADMIN_ENV)

    assert diagnosis.returncode == 1
    failure = diagnosis.checks["segment"]
    assert failure.outcome == "FAIL", diagnosis.output
    assert failure.seen.startswith(f"{path} here is file ")
    assert ", but the agent maps file " in failure.seen
    assert "replaced or removed since the agent started" in failure.seen
    assert failure.fix is not None and failure.fix.startswith("restart the agent")
    deadline = time.monotonic() + 10
    while not any(f"{path} no longer named this agent's" in line for line in agent.log):
        assert time.monotonic() < deadline, "".join(agent.log)
        time.sleep(0.1)


def test_the_canary_tells_another_file_where_the_agent_does_not_name_its_own(
    agent: AgentProcess,
) -> None:
    """An older agent names no file in its hello: the canary still tells a copy."""
    copy = Path("/dev/shm") / f"kvpool-doctor-copy-{os.getpid()}"
    shutil.copyfile(agent.segment_path, copy)
    mapped = SharedSegment.attach(copy)
    try:
        with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
            check = canary.check_canary(client, mapped)
    finally:
        mapped.close()
        copy.unlink()

    assert check.outcome == "FAIL"
    assert check.seen.startswith("canary mismatch: the agent wrote the canary at offset ")
    assert f"of its segment {agent.segment_path}; this pod's {copy} holds other" in check.seen
    assert check.fix is not None and "--segment-path" in check.fix
    assert usage(agent)[CANARY_TENANT]["chunks"] == 0  # cleared all the same


def test_an_agent_that_refuses_the_protocol(
    agent: AgentProcess, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client of another protocol version: the real agent answers unsupported_version."""
    monkeypatch.setattr(protocol, "PROTOCOL_VERSION", protocol.PROTOCOL_VERSION + 1)
    monkeypatch.setenv("KVPOOL_TOKEN", ENGINE_TOKEN)

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
        *agent_args(agent), "--block-size", "96", env={"KVPOOL_CHUNK_TOKENS": "256"}
    )

    assert diagnosis.returncode == 1
    assert diagnosis.checks["chunk-size"].outcome == "FAIL", diagnosis.output
    assert "96" in diagnosis.checks["chunk-size"].seen


def test_a_missing_or_refused_token_is_one_fail_line_with_the_fix(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """As the connector: no token anywhere, then a token the agent does not know."""
    for env, seen in (
        ({"KVPOOL_TOKEN": "", "HOME": str(tmp_path)}, "no token for the kvpool agent: set"),
        ({"KVPOOL_TOKEN": "not-a-token-of-this-pool"}, f"the agent at {agent.zmq} refused"),
    ):
        diagnosis = run_doctor(*agent_args(agent), env=env)
        assert diagnosis.returncode == 1
        failure = diagnosis.checks["agent"]
        assert failure.outcome == "FAIL" and failure.seen.startswith(seen), failure
        assert failure.fix is not None and "KVCacheTenant's Secret" in failure.fix
        assert diagnosis.checks["canary"].outcome == "SKIP"
