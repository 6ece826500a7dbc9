"""The agent's door: a Unix socket that hands a connector the chunk files its token may map.

The wire is :mod:`kvpool.common.door`'s: one JSON request line, one reply line, a chunk file's
descriptor attached to a grant (``SCM_RIGHTS``), then the agent closes the connection. The
token is checked afresh on every request (a revoked token maps nothing more; what it mapped
stays mapped), and :meth:`~kvpool.common.auth.TokenAuthority.file_access` says how:
the file is opened ``O_RDWR`` or ``O_RDONLY`` accordingly, never following a link, and
handed out only if it is still the file of that id (a regular file with that inode). A
refusal is one line, and never names the owner of a file the token may not map, nor tells
a file it may not map from an id no file has.

The socket is mode 0666 (any user of a pod may connect: the token is the check) in a
directory of the agent's (0755). One thread serves it with a :mod:`selectors` loop over
non-blocking sockets, none of which it ever waits on. Before a client is authenticated it
holds little: a request of at most ``request_bytes``, ``seconds`` from accept for the whole
exchange, at most ``max_pending`` connections at once, and a new one past those drops the
oldest; so strangers that connect and stall cannot keep out a real client, which is served
within milliseconds of its connect. A reply the client would not take at once (replies are
a few dozen bytes) drops it. Each kind of refusal is one line at INFO at most once a minute
(its details at DEBUG), so that a flood of them cannot fill the log.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvpool.common.auth import FileAccess, Principal, Role, TokenAuthority
from kvpool.common.door import (
    DOOR_REQUEST_BYTES,
    DOOR_SECONDS,
    DoorRequestError,
    grant_line,
    parse_request,
    refusal_line,
)
from kvpool.common.files import FileRefused, check_socket_replaceable, ensure_directory
from kvpool.common.web.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

SOCKET_MODE = 0o666
"""The door's socket: any user of a pod may connect (the token is the check)."""
DIRECTORY_MODE = 0o755
"""The door's directory (a pod is given it whole), the agent's own."""
MAX_PENDING = 64
"""Connections open at once by default; a new one past these drops the oldest."""
_ACCEPTS_PER_WAKE = 64
"""Then the loop reads what the open connections sent before it accepts more."""
_ACCEPT_PAUSE_SECONDS = 0.1
"""How long the loop stops accepting when the process is out of descriptors."""


class ChunkFileSource(Protocol):
    """The agent's chunk files by id (called on the door's thread)."""

    def chunk_file(self, file_id: int) -> tuple[str, Path] | None:
        """The owner (an L1 account's tenant id) and the path of the chunk file whose inode
        is ``file_id``; None if there is none."""


class Refusal(enum.StrEnum):
    """Why the door gave a connection no chunk file (:attr:`DoorStats.refused`)."""

    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    UNKNOWN_FILE = "unknown_file"
    GONE = "gone"
    UNOPENED = "unopened"
    MALFORMED = "malformed"
    TOO_LONG = "too_long"
    TIMEOUT = "timeout"
    EVICTED = "evicted"
    UNSENT = "unsent"
    INTERNAL = "internal"


@dataclass
class DoorStats:
    granted: int = 0
    """Chunk files handed out."""
    refused: Counter[Refusal] = field(default_factory=Counter)
    """Connections closed without a chunk file, by why (a client that hung up before its
    request is not counted)."""


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    deadline: float
    received: bytearray = field(default_factory=bytearray)


class DoorServer:
    """Serves the door at ``path`` on a thread of its own, from :meth:`start` to :meth:`close`."""

    def __init__(
        self,
        path: Path,
        authority: TokenAuthority,
        files: ChunkFileSource,
        *,
        max_pending: int = MAX_PENDING,
        request_bytes: int = DOOR_REQUEST_BYTES,
        seconds: float = DOOR_SECONDS,
    ) -> None:
        if max_pending < 1 or request_bytes < 2 or seconds <= 0:
            raise ValueError("a door needs max_pending >= 1, request_bytes >= 2, seconds > 0")
        self.path = path
        self.stats = DoorStats()
        self._authority = authority
        self._files = files
        self._max_pending = max_pending
        self._request_bytes = request_bytes
        self._seconds = seconds
        self._log_lines = _log_lines(max_pending, request_bytes, seconds)
        self._refusals = RateLimitedLog(log)
        self._open: dict[int, _Connection] = {}
        """By descriptor, oldest first (each has ``seconds`` from its accept: first to expire)."""
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None
        self._wake, self._waker = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accept_resumes: float | None = None

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed."""
        return len(self._open)

    def start(self) -> None:
        """Make the socket (replacing a stale one of the agent's) and serve it.

        :class:`~kvpool.common.files.FileRefused` if the directory, or what is at ``path``, is
        not the agent's to use, or another process serves a socket there.
        """
        if self._listener is not None or self._stopping:
            raise RuntimeError("a door starts once")
        try:
            self._listener = self._bind()
            self._listener.setblocking(False)
            self._listener.listen(socket.SOMAXCONN)
            self._wake.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._selector.register(self._wake, selectors.EVENT_READ)
            thread = threading.Thread(target=self._serve, name="kvpool-door", daemon=True)
            thread.start()
        except BaseException:
            self.close()  # a door that failed to start is closed
            raise
        self._thread = thread
        log.info("door: serving chunk files at %s", self.path)

    def close(self) -> None:
        """Stop serving: close every connection and remove the socket if it is still ours."""
        if self._stopping:
            return
        self._stopping = True
        if self._thread is not None:
            with contextlib.suppress(OSError):
                self._waker.send(b"x")
            self._thread.join()
        else:
            self._close_all()
        self._waker.close()
        self._unlink()

    # ---------------------------------------------------------------- the socket

    def _bind(self) -> socket.socket:
        ensure_directory(self.path.parent, what="door directory", mode=DIRECTORY_MODE, own=True)
        if check_socket_replaceable(self.path, "door socket"):
            if _served(self.path):
                status = os.lstat(self.path)
                raise FileRefused(
                    f"refusing door socket {self.path}: another process serves it (owner uid "
                    f"{status.st_uid}); is another agent of this pool running?"
                )
            self.path.unlink()
            log.info("door: replaced the stale socket %s", self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(os.fsdecode(self.path))
            status = os.lstat(self.path)
            self._identity = (status.st_dev, status.st_ino)
            os.chmod(self.path, SOCKET_MODE)
        except BaseException:
            listener.close()
            self._unlink()
            raise
        return listener

    def _unlink(self) -> None:
        """Remove the socket if ``path`` still names the one this door bound."""
        if self._identity is None:
            return
        with contextlib.suppress(OSError):
            status = os.lstat(self.path)
            if (status.st_dev, status.st_ino) == self._identity:
                self.path.unlink()
        self._identity = None

    # ---------------------------------------------------------------- the loop

    def _serve(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(self._timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake:
                        with contextlib.suppress(OSError):
                            self._wake.recv(64)
                    elif key.data is not None:
                        self._read(key.data)
                self._expire()
        except Exception:
            log.exception("door: the loop failed; the door at %s is closed", self.path)
        finally:
            self._close_all()

    def _timeout(self) -> float | None:
        deadlines = [] if self._accept_resumes is None else [self._accept_resumes]
        oldest = next(iter(self._open.values()), None)
        if oldest is not None:
            deadlines.append(oldest.deadline)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._open:
            oldest = next(iter(self._open.values()))
            if oldest.deadline > now:
                break
            self._refuse(oldest, Refusal.TIMEOUT, f"no request within {self._seconds:g} s")
        if self._accept_resumes is not None and now >= self._accept_resumes:
            self._accept_resumes = None
            assert self._listener is not None
            self._selector.register(self._listener, selectors.EVENT_READ)

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as error:
                if error.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    continue  # that client is gone already
                self._refusals.warning(f"door: accept() failed ({error.strerror}); retrying")
                self._selector.unregister(self._listener)
                self._accept_resumes = time.monotonic() + _ACCEPT_PAUSE_SECONDS
                return
            if len(self._open) >= self._max_pending:
                oldest = next(iter(self._open.values()))
                self._refuse(oldest, Refusal.EVICTED, "the door is busy; try again")
            sock.setblocking(False)
            connection = _Connection(sock, time.monotonic() + self._seconds)
            self._open[sock.fileno()] = connection
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _read(self, connection: _Connection) -> None:
        if connection.sock.fileno() not in self._open:
            return  # closed earlier in this round (dropped for a newer one)
        try:
            data = connection.sock.recv(self._request_bytes - len(connection.received))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client hung up before its request
            self._close(connection)
            return
        connection.received += data
        end = connection.received.find(b"\n")
        if end >= 0:
            self._answer(connection, bytes(connection.received[:end]))
        elif len(connection.received) >= self._request_bytes:
            line = f"the request is longer than {self._request_bytes} bytes"
            self._refuse(connection, Refusal.TOO_LONG, line)

    # ---------------------------------------------------------------- a request

    def _answer(self, connection: _Connection, line: bytes) -> None:
        try:
            self._grant(connection, line)
        except Exception:
            self._refusals.exception("door: internal error serving a request")
            self._refuse(connection, Refusal.INTERNAL, "internal error; see the agent's log")

    def _grant(self, connection: _Connection, line: bytes) -> None:
        try:
            token, file_id = parse_request(line)
        except DoorRequestError as error:
            self._refuse(connection, Refusal.MALFORMED, str(error))
            return
        principal = self._authority.authenticate(token)
        if principal is None:
            self._refuse(connection, Refusal.UNAUTHENTICATED, "unknown token")
            return
        found = self._files.chunk_file(file_id)
        if found is None:  # said as for a file it may not map: ids are not a way to probe
            self._refuse(connection, Refusal.UNKNOWN_FILE, _forbidden(principal, file_id))
            return
        owner, path = found
        access = self._authority.file_access(principal, owner)
        if access is None:
            self._refuse(connection, Refusal.FORBIDDEN, _forbidden(principal, file_id))
            return
        writable = access is FileAccess.READ_WRITE
        try:
            fd = _open_chunk_file(path, file_id, writable)
        except OSError as error:
            self._refusals.warning(f"door: cannot open chunk file {path}: {error.strerror}")
            self._refuse(connection, Refusal.UNOPENED, f"chunk file {file_id} cannot be opened")
            return
        if fd is None:
            self._refuse(connection, Refusal.GONE, f"chunk file {file_id} is gone")
            return
        reply = grant_line(file_id, owner, writable)
        try:
            sent = connection.sock.sendmsg(
                [reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, "little"))]
            )
        except OSError:
            sent = 0
        finally:
            os.close(fd)
        if sent != len(reply):
            self._drop(connection, Refusal.UNSENT, "it did not take its reply at once")
            return
        self.stats.granted += 1
        log.debug("door: granted %s file %d (%s)", principal, file_id, access)
        self._close(connection)

    # ---------------------------------------------------------------- closing

    def _refuse(self, connection: _Connection, reason: Refusal, line: str) -> None:
        """Count and log the refusal, send ``line`` if the client takes it at once, close."""
        self._count(reason, line)
        with contextlib.suppress(OSError):
            connection.sock.send(refusal_line(line))
        self._close(connection)

    def _drop(self, connection: _Connection, reason: Refusal, detail: str) -> None:
        self._count(reason, detail)
        self._close(connection)

    def _count(self, reason: Refusal, detail: str) -> None:
        self.stats.refused[reason] += 1
        if reason is not Refusal.INTERNAL:  # logged with its traceback already
            self._refusals.info(self._log_lines[reason])
        log.debug("door: %s: %s", reason, detail)

    def _close(self, connection: _Connection) -> None:
        fileno = connection.sock.fileno()
        if self._open.pop(fileno, None) is not None:
            self._selector.unregister(connection.sock)
        connection.sock.close()

    def _close_all(self) -> None:
        for connection in list(self._open.values()):
            self._close(connection)
        if self._listener is not None:
            self._listener.close()
        self._selector.close()
        self._wake.close()


def _open_chunk_file(path: Path, file_id: int, writable: bool) -> int | None:
    """A descriptor of the file at ``path`` if it is still chunk file ``file_id`` (a regular
    file of that inode; a link is not followed); None if it is gone or another file."""
    flags = os.O_RDWR if writable else os.O_RDONLY
    try:  # O_NONBLOCK: a FIFO at the name does not stall the loop
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            return None
        raise
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_ino != file_id:
            os.close(fd)
            return None
        os.set_blocking(fd, True)  # the client's descriptor shares the flags
    except BaseException:
        os.close(fd)
        raise
    return fd


def _forbidden(principal: Principal, file_id: int) -> str:
    """Why ``principal`` gets no file ``file_id``, naming no owner, and, to a tenant, not
    telling a file it may not map from an id no file has."""
    if principal.role is Role.TENANT:
        return f"this token acts for tenant {principal.tenant} and may not map file {file_id}"
    if principal.role in (Role.ADMIN, Role.ENGINE):  # they may map every file there is
        return f"no chunk file {file_id}"
    return f"a token of the {principal.role} role may map no chunk file"


def _served(path: Path) -> bool:
    """Whether a process accepts connections at the socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(os.fsdecode(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except BlockingIOError:
            return True  # its backlog is full: it is served
        return True


def _log_lines(max_pending: int, request_bytes: int, seconds: float) -> dict[Refusal, str]:
    """The one log line of each kind of refusal, whoever was refused."""
    return {
        Refusal.UNAUTHENTICATED: "door: refused a request with an unknown token",
        Refusal.FORBIDDEN: "door: refused a token a chunk file it may not map",
        Refusal.UNKNOWN_FILE: "door: refused a request for a chunk file the agent does not have",
        Refusal.GONE: "door: refused a chunk file no longer at its path",
        Refusal.UNOPENED: "door: refused a chunk file the agent could not open",
        Refusal.MALFORMED: "door: refused a malformed request",
        Refusal.TOO_LONG: f"door: refused a request longer than {request_bytes} bytes",
        Refusal.TIMEOUT: f"door: closed a connection with no request within {seconds:g} s",
        Refusal.EVICTED: (
            "door: dropped the oldest waiting connection for a new one "
            f"(at most {max_pending} at once)"
        ),
        Refusal.UNSENT: "door: dropped a client that did not take its reply at once",
        Refusal.INTERNAL: "door: internal error serving a request",
    }
