from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.common.segment import SEGMENT_MODE, SegmentError, SharedSegment

pytestmark = pytest.mark.process

PAGE = 4096


@pytest.fixture
def segment_path(tmp_path: Path) -> Iterator[Path]:
    # /dev/shm is where the agent puts it; tmp_path keeps tests isolated on machines without it.
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else tmp_path
    path = base / f"kvpool-test-{os.getpid()}-{tmp_path.name}"
    yield path
    path.unlink(missing_ok=True)


def test_the_segment_file_holds_its_header_and_table_only(segment_path: Path) -> None:
    segment = SharedSegment.create(segment_path, 16 * PAGE, PAGE)
    # header page, one 128-byte table record per page, then the page-aligned data region,
    # whose bytes live in the chunk files (chunk_files.py)
    assert segment.layout.table_offset == 4096 and segment.layout.table_slots == 16
    assert segment.layout.data_offset == 2 * PAGE and segment.layout.pages == 16
    assert segment_path.stat().st_size == segment.layout.file_size == 2 * PAGE
    assert segment.layout.total_size == 18 * PAGE  # how long each chunk file is
    assert stat.S_IMODE(segment_path.stat().st_mode) == SEGMENT_MODE == 0o600
    segment.close()


def test_open_adopts_a_compatible_segment_and_keeps_its_table(segment_path: Path) -> None:
    first, reason = SharedSegment.open(segment_path, 16 * PAGE, PAGE)
    assert reason == "no segment yet"
    first.table[:10] = b"still here"
    first.close()
    again, reason = SharedSegment.open(segment_path, 16 * PAGE, PAGE)
    assert reason is None
    assert bytes(again.table[:10]) == b"still here"
    again.close()


@pytest.mark.parametrize("mode", [0o660, 0o640])
def test_open_adopts_an_older_agents_segment_and_keeps_it_to_itself(
    segment_path: Path, mode: int
) -> None:
    """Agents before chunk files let their group, the connectors, map the segment (0660, or
    0640 under a umask of 022). It is still the agent's own: adopted, at the agent's mode."""
    SharedSegment.open(segment_path, 16 * PAGE, PAGE)[0].close()
    segment_path.chmod(mode)
    segment, reason = SharedSegment.open(segment_path, 16 * PAGE, PAGE)
    assert reason is None
    assert stat.S_IMODE(segment_path.stat().st_mode) == SEGMENT_MODE == 0o600
    segment.close()


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o4660])
def test_open_refuses_a_segment_others_may_have_mapped(segment_path: Path, mode: int) -> None:
    """Whoever could open it may hold a mapping still: no chmod takes that back."""
    SharedSegment.open(segment_path, 16 * PAGE, PAGE)[0].close()
    segment_path.chmod(mode)
    with pytest.raises(SegmentError) as refused:
        SharedSegment.open(segment_path, 16 * PAGE, PAGE)
    message = str(refused.value)
    assert message.startswith(f"refusing segment {segment_path}: its mode grants more than 0660")
    assert f"(owner uid {os.geteuid()}, mode {mode:04o})" in message and "\n" not in message
    assert stat.S_IMODE(segment_path.stat().st_mode) == mode  # left as it was


def test_the_segment_directory_the_agent_makes_lets_its_group_through_only(
    tmp_path: Path,
) -> None:
    path = tmp_path / "shm" / "kvpool-test"
    SharedSegment.create(path, 16 * PAGE, PAGE).close()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o710
    assert stat.S_IMODE(path.stat().st_mode) == SEGMENT_MODE


def test_a_segment_directory_where_others_may_swap_the_segment_is_refused(
    tmp_path: Path,
) -> None:
    """A connector maps whatever file is at the segment's name: in a directory every user may
    write, without the sticky bit of /dev/shm, anyone could put theirs there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(SegmentError, match="any user may rename its entries"):
        SharedSegment.open(shared / "kvpool-test", 16 * PAGE, PAGE)
    shared.chmod(0o1777)
    SharedSegment.open(shared / "kvpool-test", 16 * PAGE, PAGE)[0].close()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda path: _patch(path, 8, (1).to_bytes(4, "little")), "segment layout 1"),
        (lambda path: _patch(path, 16, (1 << 20).to_bytes(8, "little")), "damaged header"),
        (lambda path: _patch(path, 0, b"NOTKVPOO"), "not a kvpool segment"),
    ],
)
def test_open_recreates_an_old_or_damaged_segment(
    segment_path: Path, damage: Callable[[Path], None], reason: str
) -> None:
    SharedSegment.open(segment_path, 16 * PAGE, PAGE)[0].close()
    damage(segment_path)
    segment, why = SharedSegment.open(segment_path, 16 * PAGE, PAGE)
    assert why is not None and reason in why
    segment.close()
    again, why = SharedSegment.open(segment_path, 16 * PAGE, PAGE)
    assert why is None and again.layout == segment.layout  # whole again
    again.close()


def test_open_recreates_when_the_configured_size_changed(segment_path: Path) -> None:
    SharedSegment.open(segment_path, 16 * PAGE, PAGE)[0].close()
    segment, why = SharedSegment.open(segment_path, 32 * PAGE, PAGE)
    assert why is not None and "size" in why and segment.layout.pages == 32
    segment.close()


def _patch(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as handle:
        handle.seek(offset)
        handle.write(data)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a tmpfs at /dev/shm")
def test_too_small_shared_memory_is_a_clear_error(segment_path: Path) -> None:
    # tmpfs refuses a reservation larger than itself at once, before touching any page.
    with pytest.raises(SegmentError, match="is the shared-memory filesystem large enough"):
        SharedSegment.create(segment_path, 1 << 50, PAGE)
    assert not segment_path.exists()


def test_an_unwritable_location_is_a_clear_error() -> None:
    with pytest.raises(SegmentError, match="cannot create segment"):
        SharedSegment.create(Path("/proc/kvpool-cannot-exist"), 16 * PAGE, PAGE)


def test_the_agent_s_l1_imports_no_torch() -> None:
    code = (
        "import sys;"
        "import kvpool.agent.core.l1, kvpool.common.segment, kvpool.common.chunk_files;"
        "import kvpool.common.config;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
