"""A serving connection's answers, sent together where their requests came together.

A client asks for a run's chunks a few at a time (its ``Get`` s in one system call:
:meth:`~kvpool.agent.peer.links.PeerLink.fetch_run`). The server answers each in order,
and while the next request has arrived already it keeps the answers it has made, until
they pass :data:`BATCH_BYTES`, and sends them in one system call
(:meth:`~kvpool.agent.peer.transport.PeerChannel.send_frames`): a 256 KiB chunk costs
the two agents a quarter of the calls, and of the interpreter lock's hand-offs between
their threads, that it did one answer at a time (docs/platform/peers.md). An answer is
sent as soon as no request is waiting behind it, so a lone request waits for nothing; the
server sends what it holds before it blocks on anything else (a read from disk, the pace
of a bandwidth cap), and before it answers "busy" for want of the bytes they count.

What an answer's body lies in (a sealed chunk's buffer, or an authenticated chunk's L1
pages and their read lease) is held until it is sent, and the work to do once it is (the
bytes in flight counted down, the lease ended) is done then, or when the connection ends
with the answer unsent. Answers that hold L1 pages are sent by a deadline
(:meth:`Answers.send_by`, before their leases expire): a peer that takes them too slowly
is cut off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvpool.agent.peer.transport import Buffer, Frame, PeerChannel
from kvpool.agent.peer.wire import Message

T = TypeVar("T")
BATCH_BYTES = 1 << 20
"""Answers are kept while they total less (the one that passes it goes with them; a chunk
this large goes alone where none is kept): four 256 KiB chunks in one send, and the first
of them not held long."""


class Answers:
    def __init__(self, channel: PeerChannel) -> None:
        self.channel = channel
        self._frames: list[Frame] = []
        self._bytes = 0
        self._held = contextlib.ExitStack()
        self._deadline: float | None = None

    def send_by(self, deadline: float) -> None:
        """The answers made so far are sent by the monotonic time ``deadline`` (or the
        connection fails, :class:`TimeoutError`), however steadily the peer takes them."""
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def hold(self, context: contextlib.AbstractContextManager[T]) -> T:
        """``context`` entered until the answers made so far are sent (or dropped): what an
        answer's body lies in."""
        return self._held.enter_context(context)

    def once_sent(self, callback: Callable[[], None]) -> None:
        """``callback`` once the answers made so far are sent (or dropped)."""
        self._held.callback(callback)

    @property
    def holding(self) -> bool:
        """Whether answers are kept, not sent yet."""
        return bool(self._frames)

    def add(self, message: Message, body: Sequence[Buffer] = ()) -> None:
        """The next answer: sent now, with those kept before it, unless the next request is
        here already and they stay under :data:`BATCH_BYTES`."""
        self._frames.append((message, body))
        self._bytes += sum(len(piece) for piece in body)
        if self._bytes >= BATCH_BYTES or not self.channel.frame_ready():
            self.send()

    def send(self) -> None:
        frames, self._frames, self._bytes = self._frames, [], 0
        held, self._held = self._held, contextlib.ExitStack()
        deadline, self._deadline = self._deadline, None
        with held:
            if not frames:
                return
            if deadline is not None:
                self.channel.set_deadline(deadline)
            self.channel.send_frames(frames)
            if deadline is not None:  # (where the send failed, the connection goes)
                self.channel.set_deadline(None)

    def drop(self) -> None:
        """The connection ends: answers not sent are not, and what they held is let go."""
        self._frames, self._bytes, self._deadline = [], 0, None
        self._held.close()
