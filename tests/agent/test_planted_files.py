"""No local user can plant the agent's files (issue 27): a real agent, another real user.

Another user (uid 65534, through ``setpriv``) creates what the agent would create or
adopt in /dev/shm, before the agent starts: the segment, the probe table, their temporary
names, as world-writable files or as links to a file of root's. The agent refuses what is
at its own names (one line naming the file, its owner and mode; exit status 1) and never
opens what is at a temporary name; nothing planted, and no file a link points at, changes.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.client import AgentClient
from kvpool.common.keys import tenant_id
from kvpool.common.probe_table import TABLE_MODE, table_path
from kvpool.common.segment import SEGMENT_MODE, SegmentLayout
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import key
from tests.support.local_user import (
    NOBODY,
    as_nobody,
    fingerprint,
    needs_another_user,
    plant_file,
    plant_symlink,
    root_secret,
)

pytestmark = [pytest.mark.process, pytest.mark.root, needs_another_user]

PAGE = 4096
SETTINGS = {"L1_SIZE": "1MiB", "PAGE_SIZE": str(PAGE)}
LAYOUT = SegmentLayout.plan(1 << 20, PAGE)
TENANT = tenant_id("planted")
SECRET = b"root's own bytes\n"


@pytest.fixture
def planted(agent_process: AgentProcess) -> Iterator[list[Path]]:
    """Paths the test plants in /dev/shm: removed afterwards, with the agent's probe table."""
    agent_process.settings.update(SETTINGS)
    paths: list[Path] = []
    yield paths
    agent_process.kill()
    for path in [*paths, table_path(agent_process.segment_path)]:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def segment_file(agent: AgentProcess, victim: Path) -> Path:
    """A segment of the agent's very layout, the other user's, mode 0666 (the issue's case)."""
    plant_file(agent.segment_path, LAYOUT.header(), size=LAYOUT.total_size)
    return agent.segment_path


def segment_link(agent: AgentProcess, victim: Path) -> Path:
    plant_symlink(agent.segment_path, victim)
    return agent.segment_path


def table_file(agent: AgentProcess, victim: Path) -> Path:
    path = table_path(agent.segment_path)
    plant_file(path, b"KVPPROBE", size=64 + 1024 * 40)
    return path


def table_link(agent: AgentProcess, victim: Path) -> Path:
    path = table_path(agent.segment_path)
    plant_symlink(path, victim)
    return path


@pytest.mark.parametrize("plant", [segment_file, segment_link, table_file, table_link])
def test_what_another_user_planted_at_the_agents_names_is_refused_and_left_alone(
    agent_process: AgentProcess,
    planted: list[Path],
    tmp_path: Path,
    plant: Callable[[AgentProcess, Path], Path],
) -> None:
    # root's file holds a valid segment of the agent's layout: adopting it would write there
    victim = root_secret(tmp_path / "root-secret", LAYOUT.header().ljust(LAYOUT.total_size, b"\0"))
    path = plant(agent_process, victim)
    planted.append(path)
    before = fingerprint(path), fingerprint(victim)
    assert before[0] is not None
    owner, mode = before[0][0], before[0][1]
    assert owner == NOBODY

    agent_process.launch()
    assert agent_process.wait_refused() == 1
    log = "".join(agent_process.log)
    assert "Traceback" not in log
    (refusal,) = [line for line in agent_process.log if line.startswith("kvpool-agent:")]
    assert f"refusing {'probe table' if 'table' in plant.__name__ else 'segment'} {path}:" in (
        refusal
    )
    assert f"owner uid {NOBODY}, mode {mode:04o}" in refusal
    assert (fingerprint(path), fingerprint(victim)) == before
    # nothing of the agent's: no temporary left, no table, no lock, and the segment made
    # before the table was refused is removed again
    shm = path.parent
    name = agent_process.segment_path.name
    leftovers = [p.name for p in shm.iterdir() if p.name.lstrip(".").startswith(name)]
    assert leftovers == [path.name]


@pytest.mark.parametrize(
    ("segment_temporary", "table_temporary", "umask"),
    [("file", "link", 0o077), ("link", "file", 0)],
)
def test_planted_temporary_names_are_never_opened_and_the_modes_are_exact(
    agent_process: AgentProcess,
    planted: list[Path],
    tmp_path: Path,
    *,
    segment_temporary: str,
    table_temporary: str,
    umask: int,
) -> None:
    """The names an agent of PID N used for its temporaries, planted before it starts: a
    world-writable file (which it used to truncate and rename into place, the other user's)
    and a link to a file of root's (which it used to overwrite)."""
    victim = root_secret(tmp_path / "root-secret", SECRET)
    agent_process.umask = umask  # the umask neither narrows nor widens the agent's modes
    pid = agent_process.launch(hold=True)
    segment = agent_process.segment_path
    table = table_path(segment)
    names = {
        segment.with_name(f".{segment.name}.{pid}.tmp"): segment_temporary,
        table.with_name(f".{table.name}.{pid}"): table_temporary,
    }
    for path, kind in names.items():
        planted.append(path)
        if kind == "file":
            plant_file(path, b"")
        else:
            plant_symlink(path, victim)
    before = {path: fingerprint(path) for path in [*names, victim]}

    agent_process.release()
    agent_process.wait_ready()
    for path, mode in ((segment, SEGMENT_MODE), (table, TABLE_MODE)):
        status = os.lstat(path)
        assert stat.S_ISREG(status.st_mode), f"{path} is not a file"
        found = (status.st_uid, f"{stat.S_IMODE(status.st_mode):04o}")
        assert found == (os.geteuid(), f"{mode:04o}"), path
    assert {path: fingerprint(path) for path in before} == before
    with AgentClient(agent_process.zmq, token=ADMIN_TOKEN) as client:
        assert client.store(TENANT, [key(1)], [b"chunk"]) == 1
        assert client.retrieve(TENANT, [key(1)]) == [b"chunk"]
    assert agent_process.stop() == 0
    assert {path: fingerprint(path) for path in before} == before


def test_a_state_directory_another_user_made_first_is_refused(
    agent_process: AgentProcess, planted: list[Path]
) -> None:
    """A state directory under /tmp that the other user made before the agent: its entries
    would be theirs to rename and replace."""
    state = Path("/tmp") / f"kvpool-planted-state-{os.getpid()}-{agent_process.workdir.name}"
    as_nobody('umask 0 && mkdir "$1"', str(state))
    planted.append(state)
    agent_process.settings.update({"STATE_DIR": str(state)})
    agent_process.launch()
    assert agent_process.wait_refused() == 1
    (refusal,) = [line for line in agent_process.log if line.startswith("kvpool-agent:")]
    assert f"refusing state directory {state}: it belongs to another user" in refusal
    assert f"(owner uid {NOBODY}, mode 0777)" in refusal
    assert list(state.iterdir()) == []
    assert not agent_process.segment_path.exists()
