from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_agent.pinned import PinningError, pin
from kvpool_agent.segment import SegmentError, SharedSegment

PAGE = 4096


@pytest.fixture
def segment_path(tmp_path: Path) -> Path:
    # /dev/shm is where the agent puts it; tmp_path keeps tests isolated on machines without it.
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else tmp_path
    path = base / f"kvpool-test-{os.getpid()}-{tmp_path.name}"
    yield path
    path.unlink(missing_ok=True)


def test_a_client_mapping_sees_the_agents_bytes(segment_path: Path) -> None:
    agent = SharedSegment.create(segment_path, 16 * PAGE, PAGE)
    assert agent.layout.data_offset == PAGE and agent.layout.pages == 16
    offset = agent.page_offset(3)
    agent.write(offset, b"hello kv")
    client = SharedSegment.attach(segment_path)
    assert client.layout == agent.layout
    assert client.read(offset, 8) == b"hello kv"
    client.write(offset, b"HELLO")
    assert agent.read(offset, 8) == b"HELLO kv"
    client.close()
    agent.close()


def test_another_process_maps_the_same_memory(segment_path: Path) -> None:
    segment = SharedSegment.create(segment_path, 16 * PAGE, PAGE)
    code = (
        "import sys; from pathlib import Path; from kvpool_agent.segment import SharedSegment;"
        "s = SharedSegment.attach(Path(sys.argv[1])); s.write(s.page_offset(1), b'from child')"
    )
    subprocess.run([sys.executable, "-c", code, str(segment_path)], check=True)
    assert segment.read(segment.page_offset(1), 10) == b"from child"
    segment.close()


def test_attach_refuses_what_is_not_a_segment(segment_path: Path, tmp_path: Path) -> None:
    with pytest.raises(SegmentError, match="cannot open"):
        SharedSegment.attach(tmp_path / "missing")
    segment_path.write_bytes(b"x" * 100)
    with pytest.raises(SegmentError, match="not a kvpool segment"):
        SharedSegment.attach(segment_path)
    segment_path.write_bytes(b"KVPOOLS1" + (99).to_bytes(4, "little") + bytes(20))
    with pytest.raises(SegmentError, match="layout 99"):
        SharedSegment.attach(segment_path)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a tmpfs at /dev/shm")
def test_too_small_shared_memory_is_a_clear_error(segment_path: Path) -> None:
    # tmpfs refuses a reservation larger than itself at once, before touching any page.
    with pytest.raises(SegmentError, match="is the shared-memory filesystem large enough"):
        SharedSegment.create(segment_path, 1 << 50, PAGE)
    assert not segment_path.exists()


def test_an_unwritable_location_is_a_clear_error() -> None:
    with pytest.raises(SegmentError, match="cannot create segment"):
        SharedSegment.create(Path("/proc/kvpool-cannot-exist"), 16 * PAGE, PAGE)


def test_never_pinning_imports_no_torch() -> None:
    code = (
        "import sys, mmap; from kvpool_agent.pinned import pin;"
        "assert pin(mmap.mmap(-1, 4096), 'never') is None;"
        "import kvpool_agent.l1, kvpool_agent.segment, kvpool_agent.config;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_cuda_available(), reason="checks the behaviour without CUDA")
def test_pinning_without_cuda(segment_path: Path) -> None:
    segment = SharedSegment.create(segment_path, 16 * PAGE, PAGE)
    assert pin(segment.mapping, "auto") is None
    with pytest.raises(PinningError, match="pin_memory=always"):
        pin(segment.mapping, "always")
    segment.close()


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_pinning_with_cuda(segment_path: Path) -> None:
    segment = SharedSegment.create(segment_path, 16 * PAGE, PAGE)
    region = pin(segment.mapping, "always")
    assert region is not None and region.size == len(segment.mapping)
    region.release()
    segment.close()
