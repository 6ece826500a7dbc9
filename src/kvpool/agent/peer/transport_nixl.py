"""The peer transport on NIXL: frames over TCP, chunk bodies through the transfer engine.

A connection is a :class:`~kvpool.agent.peer.transport.TcpChannel` first: the
handshake, every request and every answer cross it as on the TCP transport. Once
both sides proved the pool's credential, and only then, the asking agent (the
client) lends the connection a *landing*: a buffer of its own registered with its
NIXL agent, in equal slots, and sends the server (:class:`~kvpool.agent.peer.wire.Landing`)
its agent's metadata for that buffer alone (connection and that one registration, not
the agent's other buffers). The server answers a ``Get`` by sealing (or authenticating)
the chunk into the section of a registered send buffer of its own that the landing's next
slot has, and posting one NIXL WRITE of it into that slot; it says so on the connection
(:class:`~kvpool.agent.peer.wire.Written`, with where in the landing) once the WRITE is
done, in the order of the requests, and meanwhile goes on to the next request. A client
asks small chunks a few in one send, and the server answers those that came together
together: built one after another in one section, written in one WRITE into one slot, their
``Written`` s said in one send (at 256 KiB a WRITE and a small message on each side per
chunk cost more CPU than the chunk's bytes). The client takes a body only at the start of
the next slot or right after the one it read before, in that one's slot. It has at most
one request per slot in flight (its :attr:`NixlChannel.depth`: a pipelined run's), and a
WRITE answers one or more, so no body lands on one it has not read yet, and no section is
built while its last WRITE may still read it. The client copies the body out of the landing
into the pages it reserved and opens it there, against the tenant and key it asked for,
exactly as a body received on TCP: a server (or anyone) writing into the landing at
another time makes a chunk that does not open, a miss.

Staged, not one-sided into L1: the segment holds every tenant's pages, so no peer
learns a descriptor of it; it learns one landing, written only in answer to a request
on its connection. Landings and send buffers are never freed while the agent runs
(a write a peer started before the connection closed may still arrive): they go back
to a free list, by size, for the next connection; a landing whose connection closed with
answers on their way (a run cut short, a timeout) rests first, for as long as the server
may take to write them, and so does a send buffer whose WRITEs were not done. A landing's
slots hold the largest of the last :data:`RECENT_BODIES` chunks its connection received (at
least :data:`SLOT_BYTES`), and it has as many as fit in :data:`LANDING_BUDGET`: a chunk
larger than a slot crosses TCP, and a connection whose chunks changed size (larger than a
slot, or small enough for more slots) lends a landing for them before its next request
with none in flight.

The client's agent name is ``NODE/RANDOM``: a server loads a landing only from the node
that proved itself on that connection, and a restarted agent is a new name, so no
peer ever writes through a previous process's descriptors. If NIXL cannot start (not
installed, no UCX plugin), the transport is TCP's, and says why once
(:attr:`NixlTransport.fallback`); a write that fails or outlasts the I/O timeout
ends the connection (the asker's fetch fails: a miss), as a broken TCP connection does.

UCX picks the link: TCP or shared memory between two hosts of one machine, RDMA or
NVLink where the hardware has them (``UCX_TLS``, ``UCX_NET_DEVICES``). On TCP and shared
memory UCX checks no memory keys: a peer that holds the pool's credential could write
anywhere in this agent's memory through its own UCX, where on RDMA the NIC confines it to
the landings it was given. The pool trusts its credential's holders that far already (they
hold the key every chunk is sealed with); keep the agents' ports, UCX's among them,
closed to everything else (the operator's NetworkPolicy admits only the pool's agents).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import mmap
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvpool.agent.peer.answers import BATCH_BYTES
from kvpool.agent.peer.transport import (
    DEPTH,
    Buffer,
    Frame,
    PeerChannel,
    PeerListener,
    TcpChannel,
    TcpTransport,
)
from kvpool.agent.peer.wire import (
    IDLE_SECONDS,
    MAX_META_BYTES,
    Landing,
    Message,
    Object,
    WireError,
    Written,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
ALIGN = 64 << 10
"""Slots, and a server's sections of its send buffer, are whole numbers of these."""
SLOT_BYTES = 2 * MiB + ALIGN
"""A new landing's slot size before any larger chunk was seen: a 2 MiB chunk's object (its
header is :data:`~kvpool.agent.l2.codec.HEADER`), aligned."""
MAX_SLOT_BYTES = 256 * MiB
"""A chunk larger than this crosses the connection instead."""
LANDING_BUDGET = DEPTH * SLOT_BYTES
"""A landing has as many slots (up to :data:`~kvpool.agent.peer.transport.DEPTH`, at least
one) as fit in this: the requests a client pipelines on the connection. A server refuses a
landing of more (:func:`landing_fits`): it keeps a section of its send buffer per slot."""
PROGRESS_DELAY_US = 1000
"""How long NIXL's progress thread waits for the link between rounds, in microseconds
(nixl_cu12's Python agent sets 0: a core spinning per agent, idle or not)."""
POLL_SECONDS = 50e-6
"""Between two looks at a write in flight."""
RECENT_BODIES = 16
"""A client's landing holds the largest of the last this many bodies its connection
received: a smaller record among large chunks (a state record, a tail) lends no landing of
small slots, and a run of smaller chunks does after this many."""
MEMORY = "DRAM"
_config_lock = threading.Lock()


@dataclass(frozen=True)
class _Region:
    """A buffer registered with this agent's NIXL agent (never freed: see the module)."""

    memory: mmap.mmap
    address: int
    descriptors: Any

    @property
    def view(self) -> memoryview:
        return memoryview(self.memory)


@dataclass(frozen=True)
class _Write:
    """A prepared WRITE (NIXL posts one again and again)."""

    length: int
    agent: str
    handle: Any


@dataclass(frozen=True)
class _Posted:
    """A server's WRITE into the client's landing, posted, whose ``Written`` s (one per body
    it holds) are not said yet."""

    write: _Write
    said: tuple[Written, ...]
    deadline: float
    """Past this (monotonic) time it has outlasted the I/O timeout."""


class NixlEngine:
    """This agent's NIXL agent, its registered buffers, and the peers' agents it writes to."""

    def __init__(self, node: str) -> None:
        self.name = f"{node}/{secrets.token_hex(6)}"
        self._agent = start_agent(self.name)
        self._lock = threading.Lock()
        self._free: dict[int, list[_Region]] = {}
        self._resting: list[tuple[float, _Region]] = []
        """Landings not lent again before a time (see :meth:`give_back`)."""
        self._loaded: Counter[str] = Counter()

    def region(self, length: int) -> _Region:
        """A registered buffer of at least ``length`` bytes (a whole number of MiB)."""
        length = -(-length // MiB) * MiB
        with self._lock:
            now = time.monotonic()
            for rested in [entry for entry in self._resting if entry[0] <= now]:
                self._resting.remove(rested)
                self._free.setdefault(len(rested[1].memory), []).append(rested[1])
            free = self._free.get(length)
            if free:
                return free.pop()
        memory = mmap.mmap(-1, length)
        address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        descriptors = self._agent.register_memory([(address, length, 0, "")], MEMORY)
        return _Region(memory, address, descriptors)

    def give_back(self, region: _Region, rest_until: float | None = None) -> None:
        """``region`` is free again, or from the monotonic time ``rest_until`` on (a landing
        whose connection closed with answers on their way: a peer may still write them)."""
        with self._lock:
            if rest_until is None:
                self._free.setdefault(len(region.memory), []).append(region)
            else:
                self._resting.append((rest_until, region))

    def describe(self, region: _Region) -> bytes:
        """This agent's metadata for ``region`` alone (with how to connect to it)."""
        metadata: bytes = self._agent.get_partial_agent_metadata(region.descriptors, True)
        return metadata

    def load(self, agent: str, metadata: bytes) -> None:
        """Load a peer's agent (once per connection that lends a landing of its)."""
        loaded = self._agent.add_remote_agent(metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        with self._lock:
            self._loaded[name] += 1
        if name != agent:
            self.unload(name)
            raise WireError(f"a landing of agent {name!r} said to be {agent!r}")

    def unload(self, agent: str) -> None:
        """A connection that loaded ``agent`` ended: forget it once none uses it."""
        with self._lock:
            self._loaded[agent] -= 1
            last = self._loaded[agent] <= 0
            if last:
                del self._loaded[agent]
        if last:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(agent)

    def prepare(self, source: _Region, at: int, length: int, agent: str, address: int) -> _Write:
        """A WRITE of ``length`` bytes of ``source`` from ``at`` into ``address`` of
        ``agent``'s, to post as often as wanted (:meth:`post`) and :meth:`release` once done
        with."""
        nixl = self._agent
        local = nixl.get_xfer_descs([(source.address + at, length, 0)], MEMORY)
        remote = nixl.get_xfer_descs([(address, length, 0)], MEMORY)
        try:
            handle = nixl.initialize_xfer("WRITE", local, remote, agent)
        except Exception as error:  # NIXL's own errors name no common base
            raise WireError(f"NIXL could not write to {agent}: {error}") from None
        return _Write(length, agent, handle)

    def post(self, prepared: _Write) -> None:
        """Post ``prepared`` (:meth:`done` says when it is done); :class:`WireError` if it
        failed."""
        self._settled(prepared, lambda: self._agent.transfer(prepared.handle))

    def done(self, prepared: _Write) -> bool:
        """Whether ``prepared``, posted, is done; :class:`WireError` if it failed."""
        return self._settled(prepared, lambda: self._agent.check_xfer_state(prepared.handle))

    @staticmethod
    def _settled(prepared: _Write, state_of: Callable[[], str]) -> bool:
        try:
            state = state_of()
        except Exception as error:  # NIXL's own errors name no common base
            raise WireError(f"NIXL's write to {prepared.agent} failed: {error}") from None
        if state not in ("PROC", "DONE"):
            raise WireError(f"NIXL's write to {prepared.agent} ended {state}")
        return state == "DONE"

    def release(self, prepared: _Write) -> None:
        with contextlib.suppress(Exception):  # a write in flight is aborted: nothing to add
            self._agent.release_xfer_handle(prepared.handle)


def start_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend, safe to call from several threads, whose progress
    thread waits :data:`PROGRESS_DELAY_US` between rounds."""
    from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    bindings: Any = importlib.import_module("nixl_cu12._bindings")

    base = bindings.nixlAgentConfig

    class _Config(base):  # type: ignore[misc,valid-type]
        """The binding's config, but with the progress thread's delay ours."""

        pthrDelay = property(
            base.pthrDelay.__get__,
            lambda self, _: base.pthrDelay.__set__(self, PROGRESS_DELAY_US),
        )

    config = nixl_agent_config(
        backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    with _config_lock:
        bindings.nixlAgentConfig = _Config
        try:
            agent = nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = base
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend here")
    return agent


class NixlChannel:
    """A TCP channel whose chunk bodies the server writes into the client's landing
    (``serving``: this is the server's end, the one that takes a landing and writes).

    A server posts each answer's WRITE and goes on to the next request: it says the
    answers (``Written``) whose WRITEs are done, in the order of the requests and those
    done together in one send, after it posts answers, while it waits for the next request
    (:meth:`wait_readable`, :meth:`receive`), and before any other answer. Answers to
    requests that came together come together (:mod:`~kvpool.agent.peer.answers`): their
    bodies are built one after another in the section of the slot they go into, and
    posted in one WRITE. Each slot of the landing has a section of the send buffer of its
    own, so the server builds the next bodies while earlier ones travel."""

    def __init__(
        self, tcp: PeerChannel, engine: NixlEngine, io_timeout: float, *, serving: bool
    ) -> None:
        self._tcp = tcp
        self._engine = engine
        self._io_timeout = io_timeout
        self._deadline: float | None = None
        """:meth:`set_deadline`'s: the WRITEs waited for (:meth:`_say_done`) are held to it too."""
        self.remote = tcp.remote
        self.transport = "tcp"
        self.lands = serving
        self._peer: str | None = None
        """The other side's node, once proven."""
        self._landing: _Region | None = None
        """A client's landing, lent to the server."""
        self._slots = 1
        self._slot_bytes = 0
        """The slots of the landing (a client's, lent; a server's, taken)."""
        self._writes = 0
        """WRITEs into the landing: the next goes into slot ``_writes % _slots``."""
        self._cursor: int | None = None
        """A client's: where the last body it read in the landing ends (a body written with it
        may follow it), until :attr:`_slot_end`."""
        self._slot_end = 0
        self._in_flight = 0
        """A client's: requests sent whose answers it has not read."""
        self._recent: deque[int] = deque(maxlen=RECENT_BODIES)
        """A client's: the lengths of the last bodies it received (its landing follows the
        largest)."""
        self._landed: memoryview | None = None
        """A client's: what of the last body written into the landing is still unread."""
        self._target: Landing | None = None
        """A server's: the client's landing."""
        self._outbox: _Region | None = None
        """A server's registered send buffer: a section per slot."""
        self._section = 0
        """The bytes of each section of the send buffer: room for a batch of answers
        (:data:`~kvpool.agent.peer.answers.BATCH_BYTES`) and the largest body yet, at most
        a slot."""
        self._prepared: dict[int, _Write] = {}
        """A server's prepared WRITE from each slot's section into the slot (by the slot's
        index), posted again for each WRITE of the same length."""
        self._posted: deque[_Posted] = deque()
        """A server's WRITEs posted, oldest first, whose ``Written`` is not said yet."""
        self._pending: deque[tuple[memoryview, int] | None] = deque()
        """A server's: the bodies of the answers to come, in order, handed out
        (:meth:`body_memory`) and not sent yet: each where it lies in the next WRITE's
        section, or None for one made elsewhere (copied there, or into the section of the
        WRITE after, when it is sent), with where in the section it lies."""
        self._open: int | None = None
        """A server's: where the section of the next WRITE begins in the send buffer, once
        a body is in it or handed out there (:attr:`_fill` bytes of it, from its start)."""
        self._fill = 0
        self._group: list[Written] = []
        """A server's: the bodies in the next WRITE's section, sent and not posted yet."""
        self._guard = threading.RLock()
        self._closed = False
        """Closed (maybe by another thread: the agent stops): its NIXL handles and buffers
        are let go, and a server's WRITEs are neither posted nor looked at any more."""

    @property
    def depth(self) -> int:
        """A client's requests in flight at once: one per slot of its landing, or of the
        landing its next request lends (with none in flight, for chunks of a new size), so
        that a run may send that many at once."""
        if self._landing is None:
            return DEPTH
        wanted = None if self._in_flight else self._landing_anew()
        return self._slots if wanted is None else wanted[0]

    @property
    def asks_together(self) -> int:
        """As on TCP where the server answers that many of the chunks asked for in one batch
        (:data:`~kvpool.agent.peer.answers.BATCH_BYTES`: written into one slot in one WRITE,
        their ``Written`` s said in one send); one on a landing for larger chunks,
        whose answers go one at a time anyway: each slot is asked for again as soon as it
        is read, and the server's writes wait for no request."""
        together = TcpChannel.asks_together
        if self._landing is None or (together - 1) * max(self._recent, default=0) < BATCH_BYTES:
            return together
        return 1

    def proven(self, node: str, peer_lands: bool) -> None:
        self._peer = node
        self._in_flight = 0  # the handshake's messages were no requests (one more came)
        if peer_lands:
            self._lend_landing(*landing_slots(0))

    def body_memory(self, length: int) -> memoryview | None:
        """Where the next chunk answered lies in the section of the registered send buffer
        that its WRITE goes from, after the bodies handed out before it (each call is for
        the answer after the last one's, until they are sent), where the client's landing
        takes a body of ``length`` bytes. None also where the section has no room left for
        it (the body is copied into the next WRITE's when it is sent)."""
        if not self.lands or self._target is None or length > self._slot_bytes:
            return None
        pending = self._pending
        if pending and (pending[-1] is None or not self._has_room(length)):
            pending.append(None)
            return None
        if not pending:
            self._open_section(length)
        built, at = self._take_room(length)
        pending.append((built, at))
        return built

    def send(self, message: Message, body: Sequence[Buffer] = ()) -> None:
        self.send_frames([(message, body)])

    def send_frames(self, frames: Sequence[Frame]) -> None:
        """A client's requests, in one system call (a landing lent anew first, where its
        chunks changed size and none is in flight); a server's answers: the chunks that fit
        a slot placed in WRITEs (those sent together in one, as room allows), and the
        ``Written`` s of those done said in one send."""
        if not self.lands:
            if self._landing is not None and not self._in_flight:
                wanted = self._landing_anew()
                if wanted is not None:
                    self._lend_landing(*wanted)  # before the next request (none in flight)
            self._tcp.send_frames(frames)
            self._in_flight += len(frames)
            return
        with self._guard:
            self._still_open()
            target = self._target
        if target is None:
            self._tcp.send_frames(frames)
            return
        for message, body in frames:
            length = sum(len(piece) for piece in body)
            if isinstance(message, Object) and length <= self._slot_bytes:
                self._place(body, length, target)
            else:
                self._post(target)
                self._settle(0)  # the answers before this one are said first
                self._tcp.send(message, body)
        self._post(target)
        self._say_written()

    def frame_ready(self) -> bool:
        return self._tcp.frame_ready()

    def receive(self, max_meta_bytes: int = MAX_META_BYTES) -> tuple[Message, int]:
        if self._posted:
            self._say_until_readable(self._io_timeout)
        while True:
            message, length = self._tcp.receive(max_meta_bytes)
            if not isinstance(message, Landing):
                break
            if not self.lands or self._peer is None or length:
                raise WireError("a landing from a server, or before the handshake")
            self._take_landing(message)
            if not self._tcp.wait_readable(IDLE_SECONDS):
                raise TimeoutError(f"{self.remote} sent no request after its landing")
        if self.lands:
            return message, length
        self._in_flight -= 1
        if isinstance(message, Written):
            return self._landed_object(message, length)
        if isinstance(message, Object):
            self._recent.append(length)  # it did not fit a slot
        return message, length

    def landed_body(self, length: int) -> memoryview | None:
        landed = self._landed
        if landed is None or len(landed) != length:
            return None
        self._landed = None
        return landed

    def receive_body(self, into: memoryview) -> None:
        landed = self._landed
        if landed is None:
            self._tcp.receive_body(into)
            return
        if len(into) > len(landed):
            raise WireError("a body read past what was written")
        into[:] = landed[: len(into)]
        self._landed = landed[len(into) :] if len(into) < len(landed) else None

    def wait_readable(self, timeout: float) -> bool:
        if self._posted:
            return self._say_until_readable(timeout)
        return self._tcp.wait_readable(timeout)

    def set_deadline(self, deadline: float | None) -> None:
        self._deadline = deadline
        self._tcp.set_deadline(deadline)

    def close(self) -> None:
        """Close it; a server's answers whose WRITEs are not done are not said (their send
        buffer rests, as a landing does: NIXL may still read it, or the thread that serves
        the connection still build in it)."""
        self._tcp.close()
        with self._guard:
            if self._closed:
                return
            self._closed = True
            self._let_go()

    def _let_go(self) -> None:
        """Give back what the connection held: a buffer NIXL may still read or write rests."""
        engine = self._engine
        now = time.monotonic()
        in_use = bool(self._pending or self._group) or not all(
            self._done_or_failed(posted.write) for posted in self._posted
        )
        self._forget_writes()
        if self._outbox is not None:
            engine.give_back(self._outbox, now + self._io_timeout if in_use else None)
        if self._landing is not None:
            # each answer still on its way may be written within the server's I/O timeout
            rest = (self._in_flight + 1) * self._io_timeout if self._in_flight > 0 else None
            engine.give_back(self._landing, None if rest is None else now + rest)
        self._landing = self._outbox = None
        if self._target is not None:
            engine.unload(self._target.agent)
            self._target = None

    def _landed_object(self, written: Written, length: int) -> tuple[Message, int]:
        """A client's: the body the server says it wrote, where it must have written it:
        right after the last body it read, in that body's slot (written with it), or at the
        start of the next slot."""
        landing = self._landing
        offset, cursor = written.offset, self._cursor
        following = cursor is not None and offset == cursor < self._slot_end
        room = self._slot_end - offset if following else self._slot_bytes
        start = self._writes % self._slots * self._slot_bytes
        if landing is None or length or not (following or offset == start):
            raise WireError(
                f"written {written.length} bytes at {offset} of no landing's slot "
                f"(the next is {self._slot_bytes} bytes at {start}, or follows at {cursor})"
            )
        if not 0 < written.length <= room:
            raise WireError(f"written {written.length} bytes at {offset}: past its slot")
        if not following:
            self._writes += 1
            self._slot_end = start + self._slot_bytes
        self._cursor = offset + written.length
        self._recent.append(written.length)
        self._landed = landing.view[offset : self._cursor]
        return Object(), written.length

    def _lend_landing(self, slots: int, slot_bytes: int) -> None:
        engine = self._engine
        if self._landing is not None:
            engine.give_back(self._landing)
        self._landing = landing = engine.region(slots * slot_bytes)
        self._slots, self._slot_bytes, self._writes, self._cursor = slots, slot_bytes, 0, None
        self._tcp.send(
            Landing(
                engine.name, engine.describe(landing), landing.address, slots * slot_bytes, slots
            )
        )
        self.transport = "nixl"

    def _landing_anew(self) -> tuple[int, int] | None:
        """A client's: the slots, and their bytes, of a landing for its recent bodies, where
        one did not fit a slot of the landing it has, or where there would be more slots
        (the chunks it asks for changed size); None: keep the one it has."""
        slots, slot_bytes = landing_slots(max(self._recent, default=0))
        return (slots, slot_bytes) if slot_bytes > self._slot_bytes or slots > self._slots else None

    def _take_landing(self, landing: Landing) -> None:
        if not landing.agent.startswith(f"{self._peer}/"):
            raise WireError(f"a landing of agent {landing.agent!r} from node {self._peer!r}")
        if not landing_fits(landing.length, landing.slots):
            raise WireError(f"a landing of {landing.length} bytes in {landing.slots} slots")
        if self._pending or self._group:  # an asker lends one with no answer on its way
            raise WireError("a landing while answers to earlier requests are being made")
        self._stop_writing()  # into the landing it had
        with self._guard:
            self._still_open()
            previous = self._target
            self._target = None
            if previous is not None:
                self._engine.unload(previous.agent)
            try:
                self._engine.load(landing.agent, landing.metadata)
            except WireError:
                raise
            except Exception as error:  # NIXL's own errors name no common base
                raise WireError(f"a landing NIXL could not load: {error}") from None
            self._target = landing
            self._slots, self._slot_bytes, self._writes = (
                landing.slots,
                landing.length // landing.slots,
                0,
            )
            self.transport = "nixl"

    def _place(self, body: Sequence[Buffer], length: int, target: Landing) -> None:
        """Put ``body`` in the next WRITE's section (where it was handed out, or copied after
        the bodies there), or in the section of the WRITE after it where it has no room
        (the next one posted first)."""
        pending = self._pending
        handed = pending.popleft() if pending else None
        if handed is not None:
            built, at = handed
            if not (len(body) == 1 and body[0] is built):
                raise RuntimeError("a body sent is not the one its memory was handed out for")
            self._group.append(Written(length, self._slot_of(at)))
            return
        if not self._has_room(length):
            self._post(target)
            self._open_section(length)
        copied, at = self._take_room(length)
        for piece in body:
            copied[: len(piece)] = piece
            copied = copied[len(piece) :]
        self._group.append(Written(length, self._slot_of(at)))

    def _has_room(self, length: int) -> bool:
        """Whether the next WRITE's section is open and has ``length`` bytes left."""
        return self._open is not None and self._fill + length <= self._section

    def _take_room(self, length: int) -> tuple[memoryview, int]:
        """The next ``length`` bytes of the open section, and where in it they lie."""
        assert self._outbox is not None and self._open is not None
        at = self._fill
        self._fill = at + length
        return self._outbox.view[self._open + at : self._open + self._fill], at

    def _slot_of(self, at: int) -> int:
        """Where ``at`` bytes into the next WRITE's section lands in the client's landing."""
        return self._writes % self._slots * self._slot_bytes + at

    def _post(self, target: Landing) -> None:
        """Post the WRITE of the bodies placed in the next WRITE's section into the
        landing's next slot (their ``Written`` s are said once it is done)."""
        if not self._group:
            return
        if self._pending:
            raise RuntimeError("a WRITE posted before a body handed out in it was sent")
        with self._guard:
            self._still_open()
            assert self._outbox is not None and self._open is not None
            index, length = self._writes % self._slots, self._fill
            prepared = self._prepared.get(index)
            if prepared is None or prepared.length != length:
                if prepared is not None:
                    self._engine.release(prepared)
                prepared = self._engine.prepare(
                    self._outbox,
                    self._open,
                    length,
                    target.agent,
                    target.address + index * self._slot_bytes,
                )
                self._prepared[index] = prepared
            self._engine.post(prepared)
            deadline = time.monotonic() + self._io_timeout
            self._posted.append(_Posted(prepared, tuple(self._group), deadline))
            self._writes += 1
            self._group.clear()
            self._open, self._fill = None, 0

    def _open_section(self, length: int) -> None:
        """Open the next WRITE's section of the send buffer, free (its last WRITE done), for
        bodies the first of which is ``length`` bytes: the buffer is replaced by one of larger
        sections (its WRITEs done first) where the sections are shorter."""
        if self._outbox is not None and self._section < length:
            self._stop_writing()
        self._settle(self._slots - 1)
        with self._guard:
            self._still_open()
            if self._outbox is None:
                self._section = min(aligned(BATCH_BYTES + length), self._slot_bytes)
                self._outbox = self._engine.region(self._slots * self._section)
            self._open, self._fill = self._writes % self._slots * self._section, 0

    def _stop_writing(self) -> None:
        """Wait for the WRITEs posted, then release the prepared ones and the send buffer:
        the landing or the sections change."""
        self._settle(0)
        with self._guard:
            self._still_open()
            self._forget_writes()
            if self._outbox is not None:
                self._engine.give_back(self._outbox)
                self._outbox = None

    def _done_or_failed(self, prepared: _Write) -> bool:
        """Whether ``prepared``, posted, no longer runs."""
        try:
            return self._engine.done(prepared)
        except WireError:
            return True

    def _still_open(self) -> None:
        """:class:`OSError` if :meth:`close` let the channel's NIXL state go (maybe from
        another thread); call it holding :attr:`_guard`, which keeps it until released."""
        if self._closed:
            raise OSError(f"the connection to {self.remote} was closed")

    def _say_written(self) -> None:
        """Say the answers whose WRITEs are done, oldest first, up to the first not done
        (:class:`TimeoutError` if it outlasted the I/O timeout)."""
        with self._guard:
            self._still_open()
            self._say_done()

    def _say_done(self) -> None:
        posted = self._posted
        said: list[Frame] = []
        try:
            while posted:
                oldest = posted[0]
                if not self._engine.done(oldest.write):
                    now = time.monotonic()
                    if now > oldest.deadline:
                        raise TimeoutError(
                            f"NIXL's write to {oldest.write.agent} outlasted the I/O timeout"
                        )
                    if self._deadline is not None and now > self._deadline:
                        raise TimeoutError(f"{self.remote} is past its deadline")
                    return
                posted.popleft()
                said += [(written, ()) for written in oldest.said]
        finally:
            if said:
                self._tcp.send_frames(said)

    def _settle(self, keep: int) -> None:
        """Wait until at most ``keep`` answers' WRITEs are still posted, saying the others."""
        while True:
            self._say_written()
            if len(self._posted) <= keep:
                return
            time.sleep(POLL_SECONDS)

    def _say_until_readable(self, timeout: float) -> bool:
        """Say answers as their WRITEs are done until the client sends something: whether it
        did within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._posted:
            self._say_written()
            if self._posted and self._tcp.wait_readable(POLL_SECONDS):
                return True
            if time.monotonic() > deadline:
                return False
        return self._tcp.wait_readable(max(0.0, deadline - time.monotonic()))

    def _forget_writes(self) -> None:
        """Release the prepared WRITEs: their buffer or landing changes (or the end)."""
        for prepared in self._prepared.values():
            self._engine.release(prepared)
        self._prepared.clear()


def landing_slots(body: int) -> tuple[int, int]:
    """The slots of a landing for bodies of ``body`` bytes, and their bytes."""
    slot_bytes = min(aligned(max(SLOT_BYTES, body)), MAX_SLOT_BYTES)
    return max(1, min(DEPTH, LANDING_BUDGET // slot_bytes)), slot_bytes


def aligned(length: int) -> int:
    """``length`` rounded up to a whole number of :data:`ALIGN`."""
    return -(-length // ALIGN) * ALIGN


def landing_fits(length: int, slots: int) -> bool:
    """Whether a landing of ``length`` bytes in ``slots`` is one an asker lends
    (:func:`landing_slots`): a server's send buffer, a section per slot, is at most as
    large."""
    if not 0 < slots <= DEPTH or length < slots or length // slots > MAX_SLOT_BYTES:
        return False
    return slots == 1 or length <= LANDING_BUDGET


class NixlListener:
    def __init__(self, tcp: PeerListener, engine: NixlEngine, io_timeout: float) -> None:
        self._tcp = tcp
        self._engine = engine
        self._io_timeout = io_timeout
        self.address = tcp.address

    def accept(self) -> PeerChannel:
        return NixlChannel(self._tcp.accept(), self._engine, self._io_timeout, serving=True)

    def close(self) -> None:
        self._tcp.close()


class NixlTransport:
    """NIXL where it starts; else TCP's transport, with :attr:`fallback` saying why."""

    def __init__(self, node: str) -> None:
        self._tcp = TcpTransport()
        self.engine: NixlEngine | None = None
        self.fallback: str | None = None
        try:
            self.engine = NixlEngine(node)
        except Exception as error:  # an import, a plugin, UCX: any of them means TCP
            self.fallback = f"NIXL did not start ({type(error).__name__}: {error}); peers use TCP"
            log.warning("peers.transport nixl: %s", self.fallback)

    @property
    def name(self) -> Literal["tcp", "nixl"]:
        return "tcp" if self.engine is None else "nixl"

    def connect(self, address: str, connect_timeout: float, io_timeout: float) -> PeerChannel:
        channel = self._tcp.connect(address, connect_timeout, io_timeout)
        if self.engine is None:
            return channel
        return NixlChannel(channel, self.engine, io_timeout, serving=False)

    def listen(self, host: str, port: int, io_timeout: float) -> PeerListener:
        listener = self._tcp.listen(host, port, io_timeout)
        if self.engine is None:
            return listener
        return NixlListener(listener, self.engine, io_timeout)
