"""How a worker's chunks reach the agent: its chunk files, mapped through its door, or its
messages (:mod:`kvpool.connector.inline`) where no door is reachable (with the
transport ``messages``, always).

The choice is made again whenever the link meets an agent (the first, or one restarted
from empty, with new files).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpool.client import AgentInfo
from kvpool.client.mapped_files import ChunkFileError
from kvpool.connector import inline
from kvpool.connector.copier import BlockCopier, MappedChunks
from kvpool.connector.layout import ChunkFormat
from kvpool.connector.link import AgentLink

log = logging.getLogger(__name__)

MESSAGES_ONLY = "transport=messages: KV moves through the agent's messages, no file is mapped"


@dataclass(frozen=True)
class Part:
    """What a job moves (chunks, or state records): their format and the copier of their
    groups' layers."""

    format: ChunkFormat
    copier: BlockCopier


Parts = Mapping[bool, Part]
"""By :attr:`~kvpool.connector.jobs.LoadJob.state`: what a job moves."""


class ChunkTransport:
    def __init__(
        self,
        *,
        rank: int,
        link: AgentLink,
        parts: Parts,
        door_path: Callable[[AgentInfo], Path | None],
        before_unmap: Callable[[], None],
    ) -> None:
        """``parts``: the worker's, filled when vLLM registers its caches;
        ``before_unmap``: finish every copy through the mapped files (they are closed
        next)."""
        self._rank = rank
        self._link = link
        self._parts = parts
        self._door_path = door_path
        self._before_unmap = before_unmap
        self._files: MappedChunks | None = None
        self.inline: int | None = None
        """Without chunk files: the agent's ``max_inline_bytes`` when chunks travel
        through its protocol instead (:mod:`kvpool.connector.inline`), else None."""
        self._said_unmapped: tuple[Path | None, str, bool] | None = None
        """Why chunk files were last not used, said once (see :meth:`on_new_agent`)."""

    def on_new_agent(self, info: AgentInfo) -> None:
        """The link met an agent (first or restarted): map chunk files through its door from
        now on, unless those mapped go with the same segment (an agent that started from
        empty has new files).

        Without the agent's door, chunks travel through the agent's protocol instead; with
        the transport ``messages`` (no door), always.
        """
        door = self._door_path(info)
        if door is None:
            self._without_files(info, None, MESSAGES_ONLY)
            return
        mapped = self._files
        if (
            mapped is not None
            and mapped.files.door == door
            and mapped.identity == info.segment_identity
        ):
            return
        self.unmap()
        if not door.is_socket():
            self._without_files(info, door, f"no agent's door at {door}")
            return
        self._said_unmapped, self.inline = None, None
        self._files = MappedChunks(self._link.chunk_files(door), info.segment_identity)
        log.info("kvpool worker %d: maps chunk files from the agent's door %s", self._rank, door)

    def _without_files(self, info: AgentInfo, path: Path | None, reason: str) -> None:
        """No chunk files to copy through (``path`` None: none asked for, the transport
        ``messages``): move chunks through the agent's protocol if they fit in its messages;
        say which, once. (Before the caches are registered nothing is decided: the next load
        or store maps again.)"""
        if not self._parts:
            return
        size = max(part.format.chunk_bytes for part in self._parts.values())
        usable = inline.fits(size, info.max_inline_bytes)
        self.inline = info.max_inline_bytes if usable else None
        if self._said_unmapped == (path, reason, usable):
            return
        self._said_unmapped = (path, reason, usable)
        if usable and path is None:
            log.info("kvpool worker %d: %s", self._rank, reason)
        elif usable:
            log.warning(
                "kvpool worker %d: %s; moving KV through the agent over the network instead "
                "(slower than mapping its chunk files: give the pod the agent's door, as "
                "kvpool's admission webhook does)",
                self._rank,
                reason,
            )
        else:
            log.warning(
                "kvpool worker %d: %s, and a chunk (%d bytes) is larger than the agent's "
                "max_inline_bytes (%d), so it cannot travel through the agent either: "
                "nothing is loaded or stored",
                self._rank,
                reason,
                size,
                info.max_inline_bytes,
            )

    def unmap(self) -> None:
        """Close the mapped chunk files, once every copy through them has finished."""
        if self._files is None:
            return
        self._before_unmap()
        self._files.close()
        self._files = None

    def mapped(self) -> MappedChunks | None:
        """The agent's chunk files; None when chunks travel through the agent's protocol
        (the link maps again when it meets a new agent). ChunkFileError: neither works."""
        if self._files is None and self.inline is None:
            self.on_new_agent(self._link.info())
        if self._files is None and self.inline is None:
            raise ChunkFileError("the agent's chunk files are not mapped")
        return self._files
