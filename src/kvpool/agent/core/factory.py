"""Build the L1 pieces (segment, chunk files, journal, index) from the agent's configuration.

A segment left by an earlier agent is adopted when compatible and its index
rebuilt from the chunk table, so a restart keeps the cache hot; otherwise it is
recreated from empty, and the reason is logged and kept for metrics; the chunk files go
with it (adopted with an adopted segment, made anew with a new one). A segment or
probe table that is not the agent's own file (another user's, a link, a mode wider
than the agent's) is refused: the agent does not start (:mod:`kvpool.common.files`).

Only the segment's owner opens it: :func:`claim_segment` first, for as long as the agent
lives (see :mod:`kvpool.common.segment`), so that no two agents adopt one segment.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from kvpool.agent.core.journal import SegmentJournal
from kvpool.agent.core.l1 import L1Cache
from kvpool.agent.core.policies import policy_factory
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.common.chunk_files import (
    ChunkFiles,
    files_directory,
    generation_directory,
    remove_other_generations,
)
from kvpool.common.config import AgentConfig
from kvpool.common.files import FileRefused, LockFile, Undo
from kvpool.common.probe_table import ProbeTableWriter, table_kept, table_path
from kvpool.common.segment import (
    LOCK_MODE,
    SegmentError,
    SharedSegment,
    check_directory,
    lock_path,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentOrigin:
    """How this agent came by its segment."""

    adopted: bool
    reason: str
    """Why it was recreated, or "adopted"."""
    restored_chunks: int
    discarded_records: int
    seconds: float


@dataclass
class L1Tier:
    """The mapped segment, the chunk files and the cache that manages them; ``close`` undoes
    ``open_l1``."""

    segment: SharedSegment
    files: ChunkFiles
    journal: SegmentJournal
    probe_table: ProbeTableWriter
    cache: L1Cache
    origin: SegmentOrigin

    def displaced(self) -> list[Path]:
        """The agent's files whose names no longer name them (removed or replaced by someone
        else): a client that maps the name now sees another file."""
        files = (self.segment, self.probe_table)
        return [file.path for file in files if not file.is_at_path()]

    def close(self) -> None:
        self.probe_table.close()
        self.files.close()
        self.journal.close()
        self.segment.close()


def claim_segment(path: Path) -> LockFile | str:
    """Take the owner lock of the segment at ``path`` (checking, or making, its directory):
    the lock, held until released, or who holds it now.

    Agents before the lock held only their probe table's: while such an agent lives, the
    segment is its own too (the lock just taken is let go).
    """
    check_directory(path)
    lock = lock_path(path)
    try:
        held = LockFile.claim(lock, what="segment lock", mode=LOCK_MODE)
    except FileRefused:
        raise
    except OSError as error:
        raise SegmentError(f"cannot lock segment {path} ({lock}): {error.strerror}") from None
    if isinstance(held, LockFile) and table_kept(table_path(path)):
        held.release()
        return f"an older agent (it holds {table_path(path)})"
    return held


def open_l1(config: AgentConfig, agent_id: str, undo: Undo | None = None) -> L1Tier:
    """The agent's L1 (the segment's owner lock must be held, see :func:`claim_segment`).

    With ``undo``, a segment it creates (not one it adopts) stays under a temporary name,
    noted there, until the start succeeds (:meth:`Undo.keep`): a failed start leaves an
    earlier segment at the path as it was.
    """
    started = time.perf_counter()
    path = config.resolved_segment_path
    segment, recreated_because = SharedSegment.open(
        path, int(config.l1_size), int(config.page_size), pending=undo is not None
    )
    if undo is not None:  # a failed start leaves no directory it made
        undo.directories(files_directory(path) / str(segment.identity[1]))
    directory = generation_directory(path, segment.identity[1])

    def install() -> None:  # the new segment takes its name: the earlier one's files go
        segment.install()
        remove_other_generations(directory)

    if undo is not None and segment.pending is not None:
        undo.pending(segment.pending, install)
    with contextlib.ExitStack() as opened:  # if anything below fails, what is open closes
        opened.callback(segment.close)
        layout = segment.layout
        files = ChunkFiles.open(
            directory,
            layout.total_size,
            layout.page_size,
            layout.data_offset,
            adopt=recreated_because is None,
        )
        opened.callback(files.close)
        if segment.pending is None:  # adopted, or made and installed at once
            remove_other_generations(directory)
        probe_table = ProbeTableWriter(table_path(path), segment.layout.pages, agent_id)
        opened.callback(probe_table.close)
        journal = SegmentJournal(segment)
        opened.callback(journal.close)  # its views of the segment go before the mapping
        cache = L1Cache(
            segment.layout,
            policy_factory(config.eviction_policy),
            QuotaBook(default=_limit(config.default_tenant_quota)),
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
            lease_seconds=config.lease_seconds,
            journal=journal,
            probe_table=probe_table,
            pin_budget=int(config.default_pin_budget),
            backing=files,
        )
        if recreated_because is None:
            report = cache.restore(journal.committed(), journal.reserved())
            origin = SegmentOrigin(
                True, "adopted", report.restored, report.discarded, time.perf_counter() - started
            )
            log.info(
                "adopted segment %s: %d chunks restored, %d damaged records discarded, "
                "%d reserved chunks quarantined, in %.3f s",
                path,
                report.restored,
                report.discarded,
                report.quarantined,
                origin.seconds,
            )
        else:
            journal.reset()
            origin = SegmentOrigin(False, recreated_because, 0, 0, time.perf_counter() - started)
            level = logging.INFO if recreated_because == "no segment yet" else logging.WARNING
            log.log(level, "created segment %s from empty: %s", path, recreated_because)
        opened.pop_all()
    log.info(
        "L1 segment %s: %d pages of %d bytes, policy %s",
        path,
        segment.layout.pages,
        segment.layout.page_size,
        config.eviction_policy,
    )
    return L1Tier(segment, files, journal, probe_table, cache, origin)


def _limit(value: int | None) -> int | None:
    return None if value is None else int(value)
