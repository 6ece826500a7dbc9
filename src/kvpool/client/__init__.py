"""Client library for the agent's ZMQ protocol: :class:`AgentClient` (blocking) and
:class:`AsyncAgentClient` (asyncio), with the same methods. Public surface: those two,
:class:`AgentError`, :class:`AgentUnavailable` and :func:`read_token`.

Both speak through one DEALER socket, time every request out, and recover by
themselves: a request that times out closes the socket (so nothing stale is
delivered later) and the next call reconnects; a restarted agent answers
``unknown_session`` and the client says hello again and resends, for the
requests where that is safe (not for lease operations: the leases died with
the old agent). A session fenced for a write lease that expired before its
commit (``session_fenced``) is left the same way: its leases are void, and the
old session is left to the agent's idle sweep, never ended by the client, so
that its quarantined pages outlive any copy still running late. A client never
waits longer than its timeout.

The zero-copy helpers :meth:`AgentClient.store` and :meth:`AgentClient.retrieve`
map the chunk files the agent names (from its door, :mod:`kvpool.client.mapped_files`) and
copy the bytes themselves; the ``*_inline`` methods send the bytes over the socket instead.

Every client says who it is: ``token`` is a bearer token of the pool (an admin's, an
engine's, an index's or a KVCacheTenant's), sent with each hello. A refused one raises
:class:`AgentError` with code ``unauthenticated``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from kvpool.client.mapped_files import MappedChunkFiles
from kvpool.common import protocol as p
from kvpool.common.transfer_results import LookupResult, StorePlan, StoreResult

T = TypeVar("T")
Payload = bytes | memoryview


class AgentUnavailable(ConnectionError):
    """The agent did not answer within the timeout (down, restarting or overloaded)."""


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the file and why."""


def read_token(path: Path) -> str:
    """The bearer token in ``path`` (one line; surrounding whitespace is dropped)."""
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise TokenFileError(f"cannot read the token file {path}: {error}") from error
    if not token or any(character.isspace() for character in token):
        raise TokenFileError(f"{path}: expected one token on one line")
    return token


class AgentError(RuntimeError):
    """The agent refused a request; ``code`` is a :class:`~kvpool.common.protocol.ErrorCode`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class AgentInfo:
    """What the agent said in reply to hello."""

    agent_id: str
    session: int
    segment_path: Path
    data_offset: int
    data_size: int
    page_size: int
    max_inline_bytes: int
    max_keys: int
    tenant: str
    """The tenant a KVCacheTenant's token acts for; "" for the other roles."""
    segment_identity: tuple[int, int] = (0, 0)
    """Device and inode of the agent's segment: new ones mean new chunk files."""
    door_path: Path | None = None
    """The agent's door as the agent sees it (None: it does not say)."""


@dataclass(frozen=True)
class PrefetchProgress:
    """See :class:`~kvpool.common.protocol.PrefetchStatusReply`."""

    done: bool
    expected: int
    loaded: int


@dataclass(frozen=True)
class _Exchange(Generic[T]):
    build: Callable[[int, int], Any]
    """(req, session) -> request message."""
    parse: Callable[[Any, list[bytes]], T]
    frames: Sequence[Payload] = ()
    resend_after_hello: bool = True


def _expect(kind: type[T]) -> Callable[[Any, list[bytes]], T]:
    def parse(reply: Any, data: list[bytes]) -> T:
        if not isinstance(reply, kind):
            raise AgentError(p.ErrorCode.MALFORMED, f"expected {kind.__name__}, got {reply!r}")
        return reply

    return parse


def _acknowledged(reply: Any, data: list[bytes]) -> None:
    _expect(p.Ok)(reply, data)


_SESSION_LOST = frozenset((p.ErrorCode.UNKNOWN_SESSION, p.ErrorCode.SESSION_FENCED))
"""Replies after which the client says hello again (and resends what is safe to resend)."""
_GOODBYE_TIMEOUT_S = 1.0
"""The longest :meth:`AgentClient.close` waits for the agent (see ``_goodbye_timeout``)."""


def _no_lease(lease: int) -> int | None:
    return None if lease == p.NO_LEASE else lease


def _found(answer: p.LookupReply) -> LookupResult:
    return LookupResult(_no_lease(answer.lease), answer.offsets, answer.sizes, answer.file)


class _Requests:
    """Builds every request and parses its reply; shared by both clients."""

    @staticmethod
    def lookup(
        tenant: str, keys: Sequence[bytes], lock: bool, count: bool
    ) -> _Exchange[LookupResult]:
        def parse(reply: Any, data: list[bytes]) -> LookupResult:
            return _found(_expect(p.LookupReply)(reply, data))

        return _Exchange(
            lambda req, s: p.Lookup(req, s, tenant, list(keys), lock, count=count), parse
        )

    @staticmethod
    def lookup_prefetch(
        tenant: str, keys: Sequence[bytes], parent: bytes | None, lock: bool, count: bool
    ) -> _Exchange[tuple[LookupResult, int]]:
        def parse(reply: Any, data: list[bytes]) -> tuple[LookupResult, int]:
            answer = _expect(p.LookupReply)(reply, data)
            return _found(answer), answer.prefetch

        return _Exchange(
            lambda req, s: p.Lookup(req, s, tenant, list(keys), lock, True, parent, count), parse
        )

    @staticmethod
    def prefetch_status(prefetch: int, wait_ms: int) -> _Exchange[PrefetchProgress]:
        def parse(reply: Any, data: list[bytes]) -> PrefetchProgress:
            answer = _expect(p.PrefetchStatusReply)(reply, data)
            return PrefetchProgress(answer.done, answer.expected, answer.loaded)

        return _Exchange(
            lambda req, s: p.PrefetchStatus(req, s, prefetch, wait_ms),
            parse,
            resend_after_hello=False,
        )

    @staticmethod
    def prepare_store(
        tenant: str, keys: Sequence[bytes], sizes: Sequence[int], parent: bytes | None
    ) -> _Exchange[StorePlan]:
        def parse(reply: Any, data: list[bytes]) -> StorePlan:
            answer = _expect(p.PrepareStoreReply)(reply, data)
            return StorePlan(_no_lease(answer.lease), answer.offsets, answer.refused, answer.file)

        return _Exchange(
            lambda req, s: p.PrepareStore(req, s, tenant, list(keys), list(sizes), parent), parse
        )

    @staticmethod
    def commit_store(lease: int, count: int | None) -> _Exchange[int]:
        return _Exchange(
            lambda req, s: p.CommitStore(req, s, lease, count),
            lambda reply, data: _expect(p.CommitReply)(reply, data).committed,
            resend_after_hello=False,
        )

    @staticmethod
    def release(lease: int) -> _Exchange[None]:
        return _Exchange(
            lambda req, s: p.Release(req, s, lease),
            _acknowledged,
            resend_after_hello=False,
        )

    @staticmethod
    def store_inline(
        tenant: str, keys: Sequence[bytes], chunks: Sequence[Payload], parent: bytes | None
    ) -> _Exchange[StoreResult]:
        def parse(reply: Any, data: list[bytes]) -> StoreResult:
            answer = _expect(p.StoreInlineReply)(reply, data)
            return StoreResult(answer.stored, answer.present, answer.refused)

        return _Exchange(
            lambda req, s: p.StoreInline(req, s, tenant, list(keys), parent), parse, chunks
        )

    @staticmethod
    def retrieve_inline(tenant: str, keys: Sequence[bytes]) -> _Exchange[list[bytes]]:
        def parse(reply: Any, data: list[bytes]) -> list[bytes]:
            answer = _expect(p.RetrieveInlineReply)(reply, data)
            if answer.count != len(data):
                raise AgentError(p.ErrorCode.MALFORMED, "data frames do not match the count")
            return data

        return _Exchange(lambda req, s: p.RetrieveInline(req, s, tenant, list(keys)), parse)

    @staticmethod
    def clear(tenant: str | None) -> _Exchange[int]:
        return _Exchange(
            lambda req, s: p.Clear(req, s, tenant),
            lambda reply, data: _expect(p.ClearReply)(reply, data).cleared,
        )

    @staticmethod
    def push(
        tenant: str, keys: Sequence[bytes], node: str, parent: bytes | None
    ) -> _Exchange[str | None]:
        return _Exchange(
            lambda req, s: p.Push(req, s, tenant, list(keys), node, parent),
            lambda reply, data: _expect(p.PushReply)(reply, data).unsent,
        )

    @staticmethod
    def snapshot() -> _Exchange[dict[str, list[bytes]]]:
        return _Exchange(
            p.Snapshot, lambda reply, data: _expect(p.SnapshotReply)(reply, data).tenants
        )

    @staticmethod
    def stats() -> _Exchange[dict[str, int | float]]:
        return _Exchange(
            p.Stats,
            lambda reply, data: _expect(p.StatsReply)(reply, data).stats,
        )

    @staticmethod
    def ping() -> _Exchange[str]:
        return _Exchange(p.Ping, lambda reply, data: _expect(p.Pong)(reply, data).agent_id)


def _info(reply: Any) -> AgentInfo:
    answer = _expect(p.HelloReply)(reply, [])
    return AgentInfo(
        answer.agent_id,
        answer.session,
        Path(answer.segment_path),
        answer.data_offset,
        answer.data_size,
        answer.page_size,
        answer.max_inline_bytes,
        answer.max_keys,
        answer.tenant,
        (answer.segment_device, answer.segment_inode),
        Path(answer.door_path) if answer.door_path else None,
    )


class _ClientBase:
    def __init__(
        self,
        endpoint: str,
        token: str,
        client_name: str,
        timeout: float,
        door_path: Path | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.door_path = door_path
        """The agent's door here (None: the path the agent names)."""
        self._token = token
        self.client_name = client_name
        self.timeout = timeout
        self.info: AgentInfo | None = None
        self._req = itertools.count(1)
        self._files: MappedChunkFiles | None = None

    def _goodbye_timeout(self) -> float:
        """How long :meth:`close` waits for the agent to end the session: not a request's
        whole timeout, since the agent sweeps sessions it stops hearing from anyway (a
        vLLM engine shutting down beside a dead agent must not hang)."""
        return min(self.timeout, _GOODBYE_TIMEOUT_S)

    def _configure(self, socket: zmq.Socket[Any]) -> None:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RECONNECT_IVL, 100)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        socket.connect(self.endpoint)

    def _session(self) -> int:
        assert self.info is not None
        return self.info.session

    def _hello(self) -> p.Hello:
        return p.Hello(next(self._req), p.PROTOCOL_VERSION, self.client_name, self._token)

    def _check(self, reply: Any) -> None:
        if isinstance(reply, p.Error):
            raise AgentError(reply.code, reply.message)

    def _check_frames(self, frames: Sequence[Payload]) -> None:
        """An inline payload over the agent's ``max_inline_bytes`` is refused here: a message
        much larger than that would cost the connection (the agent drops such peers)."""
        assert self.info is not None
        size = sum(memoryview(frame).nbytes for frame in frames)
        if size > self.info.max_inline_bytes:
            raise AgentError(
                p.ErrorCode.TOO_LARGE,
                f"inline payload of {size} bytes; at most {self.info.max_inline_bytes}",
            )

    def files(self) -> MappedChunkFiles:
        """The chunk files this client maps, got from the agent's door with its token."""
        if self.info is None:
            raise AgentUnavailable("not connected: call connect() first")
        door = self.door_path or self.info.door_path
        if door is None:
            raise AgentUnavailable("the agent names no door and none was given")
        if self._files is None or self._files.door != door:
            self.close_files()
            self._files = MappedChunkFiles(door, self._token, self.timeout)
        return self._files

    def close_files(self) -> None:
        """Unmap the chunk files (copies out of them must have ended)."""
        if self._files is not None:
            self._files.close()
            self._files = None


class AgentClient(_ClientBase):
    """Blocking client; one request at a time (use one client per thread)."""

    def __init__(
        self,
        endpoint: str,
        *,
        token: str,
        client_name: str = "kvpool-client",
        timeout: float = 5.0,
        door_path: Path | None = None,
    ) -> None:
        super().__init__(endpoint, token, client_name, timeout, door_path)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] | None = None
        self._awaited: set[int] = set()
        """Requests sent with :meth:`release_later` whose replies nobody has read yet."""
        self._arrived: dict[int, tuple[Any, list[bytes]]] = {}
        """Their replies that came while another reply was awaited."""

    def __enter__(self) -> AgentClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> AgentInfo:
        if self._socket is None:
            self._socket = self._context.socket(zmq.DEALER)
            self._configure(self._socket)
        reply, _ = self._roundtrip(self._hello())
        self._check(reply)
        self.info = _info(reply)
        return self.info

    def close(self) -> None:
        if self._socket is not None and self.info is not None:
            with contextlib.suppress(AgentUnavailable):
                goodbye = p.EndSession(next(self._req), self.info.session)
                self._roundtrip(goodbye, timeout=self._goodbye_timeout())
        self._reset()
        self.close_files()

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self.info = None
        self._awaited.clear()
        self._arrived.clear()

    def _roundtrip(
        self, request: Any, frames: Sequence[Payload] = (), *, timeout: float | None = None
    ) -> tuple[Any, list[bytes]]:
        socket = self._socket
        assert socket is not None
        socket.send_multipart([p.encode(request), *frames], copy=len(frames) == 0)
        return self._reply(request.req, timeout)

    def _reply(self, req: int, timeout: float | None = None) -> tuple[Any, list[bytes]]:
        """Wait for the reply to request ``req``, keeping those of requests sent ahead."""
        arrived = self._arrived.pop(req, None)
        if arrived is not None:
            return arrived
        socket = self._socket
        if socket is None:
            raise AgentUnavailable(f"the connection to {self.endpoint} was reset; no reply")
        timeout = self.timeout if timeout is None else timeout
        while socket.poll(int(timeout * 1000)):
            message = socket.recv_multipart()
            reply = p.decode_reply(message[0])
            if reply.req == req:
                return reply, message[1:]
            if reply.req in self._awaited:
                self._arrived[reply.req] = (reply, message[1:])
        self._reset()
        raise AgentUnavailable(f"no reply from the agent at {self.endpoint} in {timeout} s")

    def _call(self, exchange: _Exchange[T]) -> T:
        if self.info is None:
            self.connect()
        self._check_frames(exchange.frames)
        reply, data = self._roundtrip(
            exchange.build(next(self._req), self._session()), exchange.frames
        )
        if isinstance(reply, p.Error) and reply.code in _SESSION_LOST:
            self.connect()
            if exchange.resend_after_hello:
                reply, data = self._roundtrip(
                    exchange.build(next(self._req), self._session()), exchange.frames
                )
        self._check(reply)
        return exchange.parse(reply, data)

    def ping(self) -> str:
        return self._call(_Requests.ping())

    def lookup(
        self, tenant: str, keys: Sequence[bytes], *, lock: bool = True, count: bool = True
    ) -> LookupResult:
        """The leading run of ``keys`` in L1; ``count=False`` for a repeated look (no stats)."""
        return self._call(_Requests.lookup(tenant, keys, lock, count))

    def lookup_prefetch(
        self,
        tenant: str,
        keys: Sequence[bytes],
        parent: bytes | None = None,
        *,
        lock: bool = True,
        count: bool = True,
    ) -> tuple[LookupResult, int]:
        """A lookup that also starts loading the missed rest from L2: (hit, prefetch id)."""
        return self._call(_Requests.lookup_prefetch(tenant, keys, parent, lock, count))

    def prefetch_status(self, prefetch: int, *, wait_ms: int = 0) -> PrefetchProgress:
        """Progress of a prefetch; with ``wait_ms`` the agent answers when done or at the time."""
        return self._call(_Requests.prefetch_status(prefetch, wait_ms))

    def prepare_store(
        self,
        tenant: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None = None,
    ) -> StorePlan:
        return self._call(_Requests.prepare_store(tenant, keys, sizes, parent))

    def commit_store(self, lease: int, count: int | None = None) -> int:
        return self._call(_Requests.commit_store(lease, count))

    def release(self, lease: int) -> None:
        self._call(_Requests.release(lease))

    def _send(self, exchange: _Exchange[Any]) -> Any:
        """Send a request without waiting for its answer; the request sent."""
        if self.info is None:
            self.connect()
        socket = self._socket
        assert socket is not None
        request = exchange.build(next(self._req), self._session())
        socket.send(p.encode(request))
        return request

    def count_lookup(self, tenant: str, keys: Sequence[bytes]) -> None:
        """Send an unlocked lookup that counts its hits and misses, and do not wait: the
        caller found them itself (the agent's table of ready chunks), the agent keeps the
        tenant's statistics and the write-back's reuse counts. The answer is dropped."""
        self._send(_Requests.lookup(tenant, keys, False, True))

    def release_later(self, lease: int) -> Callable[[], None]:
        """Send a release now; the returned call waits for the agent's answer. The round trip
        then overlaps the caller's own work (vLLM's forward) instead of preceding it."""
        exchange = _Requests.release(lease)
        request = self._send(exchange)
        self._awaited.add(request.req)

        def answer() -> None:
            if request.req not in self._awaited:
                raise AgentUnavailable(f"the connection to {self.endpoint} was reset; no reply")
            try:
                reply, data = self._reply(request.req)
            finally:
                self._awaited.discard(request.req)
            self._check(reply)
            exchange.parse(reply, data)

        return answer

    def store_inline(
        self,
        tenant: str,
        keys: Sequence[bytes],
        chunks: Sequence[Payload],
        parent: bytes | None = None,
    ) -> StoreResult:
        return self._call(_Requests.store_inline(tenant, keys, chunks, parent))

    def retrieve_inline(self, tenant: str, keys: Sequence[bytes]) -> list[bytes]:
        return self._call(_Requests.retrieve_inline(tenant, keys))

    def clear(self, tenant: str | None = None) -> int:
        return self._call(_Requests.clear(tenant))

    def stats(self) -> dict[str, int | float]:
        return self._call(_Requests.stats())

    def push(
        self, tenant: str, keys: Sequence[bytes], node: str, parent: bytes | None = None
    ) -> str | None:
        """Offer the leading run of ``keys`` the agent holds to the agent of ``node``, which
        pulls them (a disaggregated prefill's, for its decode); why it was not sent, or
        None."""
        return self._call(_Requests.push(tenant, keys, node, parent))

    def snapshot(self) -> dict[str, list[bytes]]:
        """Every ready key by tenant (an index's or an admin's token)."""
        return self._call(_Requests.snapshot())

    def store(
        self,
        tenant: str,
        keys: Sequence[bytes],
        chunks: Sequence[Payload],
        parent: bytes | None = None,
    ) -> int:
        """Zero-copy store: reserve, copy into the mapped chunk file, commit. Returns chunks
        stored."""
        plan = self.prepare_store(tenant, keys, [len(chunk) for chunk in chunks], parent)
        if plan.lease is None:
            return 0
        copy_in(self.files(), plan, chunks)
        return self.commit_store(plan.lease)

    def retrieve(self, tenant: str, keys: Sequence[bytes]) -> list[bytes]:
        """Zero-copy retrieve: lookup with read locks, copy out of the chunk file, release."""
        hit = self.lookup(tenant, keys)
        if hit.lease is None:
            return []
        try:
            return copy_out(self.files(), hit)
        finally:
            self.release(hit.lease)


class AsyncAgentClient(_ClientBase):
    """asyncio client; concurrent calls on one client are serialised."""

    def __init__(
        self,
        endpoint: str,
        *,
        token: str,
        client_name: str = "kvpool-client",
        timeout: float = 5.0,
        door_path: Path | None = None,
    ) -> None:
        super().__init__(endpoint, token, client_name, timeout, door_path)
        self._context = zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._busy = asyncio.Lock()

    async def connect(self) -> AgentInfo:
        if self._socket is None:
            self._socket = self._context.socket(zmq.DEALER)
            self._configure(self._socket)
        reply, _ = await self._roundtrip(self._hello())
        self._check(reply)
        self.info = _info(reply)
        return self.info

    async def close(self) -> None:
        if self._socket is not None and self.info is not None:
            with contextlib.suppress(AgentUnavailable):
                goodbye = p.EndSession(next(self._req), self.info.session)
                await self._roundtrip(goodbye, timeout=self._goodbye_timeout())
        self._reset()
        self.close_files()

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self.info = None

    async def _roundtrip(
        self, request: Any, frames: Sequence[Payload] = (), *, timeout: float | None = None
    ) -> tuple[Any, list[bytes]]:
        timeout = self.timeout if timeout is None else timeout
        async with self._busy:
            socket = self._socket
            assert socket is not None
            await socket.send_multipart([p.encode(request), *frames])
            while await socket.poll(int(timeout * 1000)):
                message = await socket.recv_multipart()
                reply = p.decode_reply(message[0])
                if reply.req == request.req:
                    return reply, message[1:]
            self._reset()
            raise AgentUnavailable(f"no reply from the agent at {self.endpoint} in {timeout} s")

    async def _call(self, exchange: _Exchange[T]) -> T:
        if self.info is None:
            await self.connect()
        self._check_frames(exchange.frames)
        reply, data = await self._roundtrip(
            exchange.build(next(self._req), self._session()), exchange.frames
        )
        if isinstance(reply, p.Error) and reply.code in _SESSION_LOST:
            await self.connect()
            if exchange.resend_after_hello:
                reply, data = await self._roundtrip(
                    exchange.build(next(self._req), self._session()), exchange.frames
                )
        self._check(reply)
        return exchange.parse(reply, data)

    async def ping(self) -> str:
        return await self._call(_Requests.ping())

    async def lookup(
        self, tenant: str, keys: Sequence[bytes], *, lock: bool = True, count: bool = True
    ) -> LookupResult:
        return await self._call(_Requests.lookup(tenant, keys, lock, count))

    async def lookup_prefetch(
        self,
        tenant: str,
        keys: Sequence[bytes],
        parent: bytes | None = None,
        *,
        lock: bool = True,
        count: bool = True,
    ) -> tuple[LookupResult, int]:
        return await self._call(_Requests.lookup_prefetch(tenant, keys, parent, lock, count))

    async def prefetch_status(self, prefetch: int, *, wait_ms: int = 0) -> PrefetchProgress:
        return await self._call(_Requests.prefetch_status(prefetch, wait_ms))

    async def prepare_store(
        self,
        tenant: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None = None,
    ) -> StorePlan:
        return await self._call(_Requests.prepare_store(tenant, keys, sizes, parent))

    async def commit_store(self, lease: int, count: int | None = None) -> int:
        return await self._call(_Requests.commit_store(lease, count))

    async def release(self, lease: int) -> None:
        await self._call(_Requests.release(lease))

    async def store_inline(
        self,
        tenant: str,
        keys: Sequence[bytes],
        chunks: Sequence[Payload],
        parent: bytes | None = None,
    ) -> StoreResult:
        return await self._call(_Requests.store_inline(tenant, keys, chunks, parent))

    async def retrieve_inline(self, tenant: str, keys: Sequence[bytes]) -> list[bytes]:
        return await self._call(_Requests.retrieve_inline(tenant, keys))

    async def clear(self, tenant: str | None = None) -> int:
        return await self._call(_Requests.clear(tenant))

    async def stats(self) -> dict[str, int | float]:
        return await self._call(_Requests.stats())

    async def snapshot(self) -> dict[str, list[bytes]]:
        return await self._call(_Requests.snapshot())

    async def store(
        self,
        tenant: str,
        keys: Sequence[bytes],
        chunks: Sequence[Payload],
        parent: bytes | None = None,
    ) -> int:
        """Zero-copy store, as :meth:`AgentClient.store`."""
        plan = await self.prepare_store(tenant, keys, [len(chunk) for chunk in chunks], parent)
        if plan.lease is None:
            return 0
        copy_in(self.files(), plan, chunks)
        return await self.commit_store(plan.lease)

    async def retrieve(self, tenant: str, keys: Sequence[bytes]) -> list[bytes]:
        """Zero-copy retrieve, as :meth:`AgentClient.retrieve`."""
        hit = await self.lookup(tenant, keys)
        if hit.lease is None:
            return []
        try:
            return copy_out(self.files(), hit)
        finally:
            await self.release(hit.lease)


def copy_in(files: MappedChunkFiles, plan: StorePlan, chunks: Sequence[Payload]) -> None:
    """Copy ``chunks`` to their reserved offsets (-1: already cached, skipped)."""
    for offset, chunk in zip(plan.offsets, chunks, strict=False):
        if offset >= 0:
            files.chunk(plan.file, offset, len(chunk), write=True)[:] = chunk


def copy_out(files: MappedChunkFiles, hit: LookupResult) -> list[bytes]:
    return [
        bytes(files.chunk(hit.file, offset, size))
        for offset, size in zip(hit.offsets, hit.sizes, strict=True)
    ]
