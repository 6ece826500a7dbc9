"""A wired tenant's pod maps its own tenant's chunks, zero-copy, and no other tenant's.

The pod is a process with exactly the rights kvpool gives a tenant's pod: another uid, no
supplementary group, and a mount namespace where the node's /dev/shm is not there and the
agent's door directory is, bind-mounted read-only (what the CSI plugin publishes to it). It
holds its tenant's token. It reads its own chunk and writes its own file through the door's
descriptor; it may read, not write, its shared space's file; every other file id it asks for
is refused, and no path of the agent's is there to open.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.client import AgentClient
from kvpool.common.chunk_files import file_name, files_directory, generation_directory
from kvpool.common.keys import tenant_id
from kvpool.common.probe_table import table_path
from kvpool.common.segment import door_path
from tests.support.agent_process import AgentProcess

pytestmark = [
    pytest.mark.process,
    pytest.mark.root,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="needs root and unshare (util-linux) to make a pod's mount namespace and uid",
    ),
]

POD_UID = 1000
A, B, SPACE = tenant_id("isolation-a"), tenant_id("isolation-b"), tenant_id("isolation-space")
TOKENS = {A: "token-of-a-6f1e09c3d8b5a2743e1f0c", B: "token-of-b-2a7d4e8c0f9b1635d27c4e"}
KEY_A, KEY_B, KEY_SPACE = b"a" * 32, b"b" * 32, b"s" * 32
SIZE = 256 << 10

POD = r"""
import json, mmap, os, sys
from kvpool.common.door import DoorError, open_chunk_file

task = json.loads(sys.argv[1])
os.setgroups([])
os.setgid(task["uid"])
os.setuid(task["uid"])
door = task["door"]
found = {}


def mapped(file_id, write):
    opened = open_chunk_file(door, task["token"], file_id)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        return opened, mmap.mmap(opened.fd, 0, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(opened.fd)


opened, own = mapped(task["own_file"], write=True)
offset, size = task["own_offset"], task["size"]
found["own_writable"] = opened.writable
found["own"] = own[offset : offset + size].hex()
own[offset : offset + 4] = b"MINE"
opened, space = mapped(task["space_file"], write=False)
found["space_writable"] = opened.writable
found["space"] = space[task["space_offset"] : task["space_offset"] + size].hex()
try:
    mapped(task["space_file"], write=True)
    found["space_mapped_for_writing"] = True
except (OSError, ValueError):
    found["space_mapped_for_writing"] = False
refused = []
for file_id in task["others"]:
    try:
        open_chunk_file(door, task["token"], file_id)
        refused.append(None)
    except DoorError as error:
        refused.append(str(error))
found["others"] = refused
reached = {}
for path in task["paths"]:
    try:
        os.close(os.open(path, os.O_RDONLY))
        reached[path] = "opened"
    except OSError as error:
        reached[path] = error.strerror
found["paths"] = reached
print(json.dumps(found))
"""


@pytest.fixture
def pod_mount() -> Iterator[Path]:
    """Where the pod sees the door's directory (outside /dev/shm, reachable by its uid)."""
    path = Path(tempfile.mkdtemp(prefix="kvpool-pod-"))
    path.chmod(0o755)
    yield path
    path.rmdir()


def _run_pod(door_directory: Path, mount: Path, task: dict[str, object]) -> dict[str, object]:
    shell = (
        'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" '
        '&& mount -t tmpfs tmpfs /dev/shm && exec "$3" -c "$4" "$5"'
    )
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    result = subprocess.run(
        [
            *("unshare", "--mount", "--propagation", "private", "sh", "-c", shell, "sh"),
            *(str(door_directory), str(mount), sys.executable, POD, json.dumps(task)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    found: dict[str, object] = json.loads(result.stdout)
    return found


def test_a_tenant_s_pod_maps_its_own_chunks_and_nothing_of_another_tenant(
    agent_process: AgentProcess, pod_mount: Path
) -> None:
    agent_process.tenant_tokens = dict(TOKENS)
    agent_process.spaces = {SPACE: {"members": [A], "owners": [B]}}
    agent_process.start()
    own, secret, shared = os.urandom(SIZE), os.urandom(SIZE), os.urandom(SIZE)
    with AgentClient(agent_process.zmq, token=TOKENS[B]) as b_client:
        assert b_client.store(B, [KEY_B], [secret]) == 1
        assert b_client.store_inline(SPACE, [KEY_SPACE], [shared]).stored == 1
        b_file = b_client.lookup(B, [KEY_B], lock=False).file
    with AgentClient(agent_process.zmq, token=TOKENS[A]) as a_client:
        assert a_client.store(A, [KEY_A], [own]) == 1
        own_hit = a_client.lookup(A, [KEY_A], lock=False)
        space_hit = a_client.lookup(SPACE, [KEY_SPACE], lock=False)
    assert b_file not in (0, own_hit.file, space_hit.file)
    segment = agent_process.segment_path
    paths = [
        segment,
        table_path(segment),
        files_directory(segment),
        generation_directory(segment, segment.stat().st_ino) / file_name(B),
    ]
    task = {
        "uid": POD_UID,
        "door": str(pod_mount / door_path(segment).name),
        "token": TOKENS[A],
        "own_file": own_hit.file,
        "own_offset": own_hit.offsets[0],
        "space_file": space_hit.file,
        "space_offset": space_hit.offsets[0],
        "size": SIZE,
        # B's file, and every inode number near it: the pod does not know B's, it guesses
        "others": [b_file, *range(max(1, b_file - 200), b_file + 200)],
        "paths": [str(path) for path in paths],
    }
    task["others"] = [
        file_id for file_id in task["others"] if file_id not in (own_hit.file, space_hit.file)
    ]
    found = _run_pod(door_path(segment).parent, pod_mount, task)

    assert found["own_writable"] is True
    assert found["own"] == own.hex(), "the pod's own chunk, read from its own mapping"
    assert found["space_writable"] is False
    assert found["space"] == shared.hex()
    assert found["space_mapped_for_writing"] is False
    refusals = found["others"]
    assert isinstance(refusals, list) and None not in refusals
    assert all(
        r.endswith(f"this token acts for tenant {A} and may not map file {i}")
        for r, i in zip(refusals, task["others"], strict=True)
    ), refusals[:3]
    assert found["paths"] == {str(path): "No such file or directory" for path in paths}
    metrics = httpx.get(f"{agent_process.http}/metrics").text
    refused = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvpool_door_refused_total{")
        and ('reason="forbidden"' in line or 'reason="unknown_file"' in line)
    )
    assert refused == len(refusals), "every refusal is counted, by reason"
    with AgentClient(agent_process.zmq, token=TOKENS[B]) as b_client:
        assert b_client.retrieve(B, [KEY_B]) == [secret]
    with AgentClient(agent_process.zmq, token=TOKENS[A]) as a_client:
        assert a_client.retrieve(A, [KEY_A]) == [b"MINE" + own[4:]], "written zero-copy"


def test_a_local_user_of_the_node_opens_no_chunk_file(agent_process: AgentProcess) -> None:
    agent_process.tenant_tokens = dict(TOKENS)
    agent_process.start()
    with AgentClient(agent_process.zmq, token=TOKENS[B]) as b_client:
        assert b_client.store(B, [KEY_B], [os.urandom(SIZE)]) == 1
    segment = agent_process.segment_path
    files = generation_directory(segment, segment.stat().st_ino)
    code = (
        "import os, sys\n"
        f"os.setgroups([]); os.setgid({POD_UID}); os.setuid({POD_UID})\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        os.close(os.open(path, os.O_RDONLY)); print('opened', path)\n"
        "    except OSError as error:\n"
        "        print(error.strerror, path)\n"
    )
    paths = [segment, files_directory(segment), files, files / file_name(B)]
    result = subprocess.run(
        [sys.executable, "-c", code, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "opened" not in result.stdout
    assert result.stdout.count("Permission denied") == len(paths), result.stdout
