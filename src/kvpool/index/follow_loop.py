"""One thread that follows a changing set of ZMQ publishers: the agents' chunk events
(:mod:`kvpool.index.subscriber`) and the model servers' vLLM KV events
(:mod:`kvpool.index.engine_events`).

Each publisher followed has a SUB socket, that socket's monitor, and while it is asked for
state a DEALER; the loop polls them all and hands each publisher's ready sockets to
:meth:`FollowLoop._serve`. The set is named from any thread (:meth:`FollowLoop._want`,
which discovery calls through the subclass's ``follow``) and applied by the loop thread,
which alone touches the sockets (ZMQ sockets are not thread-safe). What a subclass adds:
how a publisher is opened, served and closed, and what is forgotten when one goes.
"""

from __future__ import annotations

import abc
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

import zmq


class Followed(Protocol):
    """What the loop polls of one followed publisher."""

    @property
    def sub(self) -> zmq.Socket[bytes]: ...

    @property
    def monitor(self) -> zmq.Socket[bytes]: ...

    @property
    def dealer(self) -> zmq.Socket[bytes] | None: ...


Config = TypeVar("Config")
State = TypeVar("State", bound=Followed)


class FollowLoop(abc.ABC, Generic[Config, State]):
    """Follows the publishers last named, each by a name (a node, a server's address)."""

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._wake_endpoint = f"inproc://{thread_name}-{uuid.uuid4().hex}"
        self._lock = threading.Lock()
        self._wanted: dict[str, Config] | None = None
        """Named by :meth:`_want` and not yet applied by the loop thread."""
        self._applied = False
        """The loop thread has applied a set once (set after it replaced ``_followed``)."""
        self._followed: dict[str, State] = {}
        """Replaced, never mutated, by the loop thread: other threads read a consistent copy."""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        wake = self._context.socket(zmq.PULL)
        wake.bind(self._wake_endpoint)
        self._thread = threading.Thread(
            target=self._run, args=(wake,), name=self._thread_name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._signal(b"stop")
        self._thread.join()
        self._thread = None

    def _want(self, wanted: dict[str, Config]) -> None:
        """Follow exactly ``wanted`` from now on (any thread; before :meth:`start` too)."""
        with self._lock:
            self._wanted = wanted
        if self._thread is not None:  # else the thread applies it when it starts
            self._signal(b"follow")

    def _all_applied(self) -> bool:
        """Whether a set was named and the loop thread has applied the last one named."""
        with self._lock:
            return self._applied and self._wanted is None

    def _signal(self, command: bytes) -> None:
        waker = self._context.socket(zmq.PUSH)
        waker.connect(self._wake_endpoint)
        waker.send(command)
        waker.close(linger=1000)

    # ------------------------------------------------------------------ loop

    def _run(self, wake: zmq.Socket[bytes]) -> None:
        self._apply_wanted()  # named before start()
        try:
            while True:
                poller = zmq.Poller()
                poller.register(wake, zmq.POLLIN)
                for state in self._followed.values():
                    poller.register(state.sub, zmq.POLLIN)
                    poller.register(state.monitor, zmq.POLLIN)
                    if state.dealer is not None:
                        poller.register(state.dealer, zmq.POLLIN)
                ready = dict(poller.poll(self._poll_timeout_ms()))
                if wake in ready:
                    if wake.recv() == b"stop":
                        return
                    self._apply_wanted()
                for name, state in list(self._followed.items()):
                    try:
                        self._serve(state, ready)
                    except Exception:  # one publisher's bug must not stop following the others
                        self._serve_failed(name, state)
        finally:
            for state in self._followed.values():
                self._close(state)
            self._followed = {}
            wake.close()

    def _poll_timeout_ms(self) -> int:
        deadlines = [when for state in self._followed.values() for when in self._deadlines(state)]
        if not deadlines:
            return -1
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _apply_wanted(self) -> None:
        with self._lock:
            wanted, self._wanted = self._wanted, None
        if wanted is None:
            return
        followed = dict(self._followed)
        for name, state in list(followed.items()):
            if wanted.get(name) != self._config(state):
                self._close(state)
                del followed[name]
                self._forget(name, still_named=name in wanted)
        for name, config in wanted.items():
            if name not in followed:
                opened = self._open(config)
                if opened is not None:
                    followed[name] = opened
        self._followed = followed
        with self._lock:
            self._applied = True

    # ------------------------------------------------------------ subclasses

    @abc.abstractmethod
    def _config(self, state: State) -> Config:
        """What ``state`` was opened with (another config for its name: it is opened anew)."""

    @abc.abstractmethod
    def _open(self, config: Config) -> State | None:
        """Connect to a publisher; None: it cannot be followed (logged)."""

    @abc.abstractmethod
    def _close(self, state: State) -> None:
        """Close every socket of ``state``."""

    @abc.abstractmethod
    def _serve(self, state: State, ready: dict[zmq.Socket[bytes], int]) -> None:
        """Handle ``state``'s ready sockets (``ready``: every ready socket) and its deadlines."""

    @abc.abstractmethod
    def _serve_failed(self, name: str, state: State) -> None:
        """:meth:`_serve` raised (the exception is being handled): log it, recover."""

    @abc.abstractmethod
    def _forget(self, name: str, *, still_named: bool) -> None:
        """``name``'s publisher is no longer followed (``still_named``: it is reopened at
        another endpoint)."""

    @abc.abstractmethod
    def _deadlines(self, state: State) -> Iterable[float]:
        """The monotonic times ``state`` must be served at even if no socket is ready."""
