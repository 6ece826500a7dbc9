"""The agent's door: where a connector gets, over a Unix socket, the chunk files it may map.

The agent keeps each L1 account's chunks (a tenant's, a shared space's, the doctor's canary
tenant's) in a sparse file of its own, known to clients by its *file id*: the file's inode
number. A pod is not given these files by path: its connector asks the door (a Unix socket,
:data:`~kvpool.common.names.DOOR_SOCKET` in the directory
:data:`~kvpool.common.names.DOOR_DIRECTORY`, found through
:data:`~kvpool.common.names.CONNECTOR_DOOR_PATH_ENV`), which checks its bearer token and hands
it the file already open (``SCM_RIGHTS``), read-write or read-only as the token may (see
:meth:`kvpool.common.auth.TokenAuthority.file_access`).

One request per connection, one JSON object on one line each way:

* request: ``{"token": "<bearer token>", "file": <file id>}\\n``, at most
  :data:`DOOR_REQUEST_BYTES` bytes with its newline (other fields are ignored);
* grant: ``{"file": <file id>, "owner": "<tenant id>", "writable": true|false}\\n`` with
  exactly one descriptor attached, open ``O_RDWR`` if writable, else ``O_RDONLY``;
* refusal: ``{"error": "<one line>"}\\n``, no descriptor.

Then the agent closes the connection. A connection has :data:`DOOR_SECONDS` from its
accept for all of it; the agent serves the door in :mod:`kvpool.agent.edge.door`, and
:func:`open_chunk_file` is the client. Standard library only: the connector imports it
inside vLLM.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

DOOR_REQUEST_BYTES = 4096
"""The longest request line (its newline included); a reply is bounded the same."""
DOOR_SECONDS = 5.0
"""From a connection's accept (or a client's connect) to the reply, all of it."""
MAX_FILE_ID = 2**64 - 1
"""The largest inode number (``ino_t`` is 64 bits)."""
_MAX_FDS = 4
"""Descriptors a client makes room for: a reply with more than one is malformed."""
_ERROR_CHARS = 300
"""The most of a refusal's text a client repeats (it comes from the agent: one line)."""


class DoorError(RuntimeError):
    """The door gave no chunk file; the message is one line naming the door and why."""


class DoorRequestError(ValueError):
    """A request line the door cannot read; the message names the field, never its value."""


@dataclass(frozen=True, slots=True)
class ChunkFile:
    """A chunk file the door opened for this process: ``fd`` is this process's to close."""

    fd: int
    owner: str
    """The L1 account whose chunks the file holds (a tenant id)."""
    writable: bool
    """Whether ``fd`` is open read-write (else read-only: map it ``PROT_READ`` only)."""
    file_id: int

    def close(self) -> None:
        os.close(self.fd)


# ---------------------------------------------------------------- the wire


def request_line(token: str, file_id: int) -> bytes:
    """The request for ``file_id`` with ``token``: one JSON line."""
    return _line({"token": token, "file": file_id})


def grant_line(file_id: int, owner: str, writable: bool) -> bytes:
    """The reply that goes with a chunk file's descriptor."""
    return _line({"file": file_id, "owner": owner, "writable": writable})


def refusal_line(reason: str) -> bytes:
    """The reply that refuses a request, ``reason`` in one line."""
    return _line({"error": reason})


def parse_request(line: bytes) -> tuple[str, int]:
    """The token and file id of a request line (without its newline);
    :class:`DoorRequestError` names what is wrong."""
    try:
        request = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise DoorRequestError("the request is not a line of JSON") from None
    if not isinstance(request, dict):
        raise DoorRequestError(f"the request is {_json_type(request)}, not a JSON object")
    token = _field(request, "token")
    if not isinstance(token, str):
        raise DoorRequestError(f"'token' must be a string, not {_json_type(token)}")
    file_id = _field(request, "file")
    if type(file_id) is not int:
        raise DoorRequestError(f"'file' must be an integer (a file id), not {_json_type(file_id)}")
    if not 0 < file_id <= MAX_FILE_ID:
        raise DoorRequestError("'file' must be a file id, an integer from 1 to 2**64 - 1")
    return token, file_id


def _field(request: dict[str, object], name: str) -> object:
    if name not in request:
        raise DoorRequestError(f"the request has no '{name}' field")
    return request[name]


def _json_type(value: object) -> str:
    """What a JSON value is, not what it says (a misplaced token must not be echoed)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    names = {str: "a string", float: "a number", list: "an array", dict: "an object"}
    return names.get(type(value), "null")


def _line(message: dict[str, object]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


# ---------------------------------------------------------------- the client


def open_chunk_file(
    door: Path, token: str, file_id: int, timeout: float = DOOR_SECONDS
) -> ChunkFile:
    """Ask the agent's ``door`` for chunk file ``file_id`` with ``token``.

    The descriptor is checked before it is returned: a regular file whose inode is
    ``file_id``, open as the grant says. :class:`DoorError` otherwise (refused, no such file,
    the door unreachable, no reply within ``timeout`` seconds, a malformed reply); no
    descriptor received is left open then.
    """
    line = request_line(token, file_id)
    if len(line) > DOOR_REQUEST_BYTES:
        raise DoorError(
            f"the request for file {file_id} at the agent's door {door} would be longer than "
            f"{DOOR_REQUEST_BYTES} bytes: the token is too long"
        )
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            _settimeout(sock, deadline)
            sock.connect(os.fsdecode(door))
        except TimeoutError:
            raise _timed_out(door, timeout) from None
        except OSError as error:
            raise DoorError(f"cannot reach the agent's door {door}: {_reason(error)}") from None
        try:
            _settimeout(sock, deadline)
            sock.sendall(line, socket.MSG_NOSIGNAL)
            reply, fds = _receive(sock, deadline)
        except _Malformed as error:
            raise _malformed(door, file_id, str(error)) from None
        except TimeoutError:
            raise _timed_out(door, timeout) from None
        except OSError as error:
            raise DoorError(
                f"the agent's door {door} closed the connection: {_reason(error)}"
            ) from None
    try:
        return _granted(door, file_id, reply, fds)
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


class _Malformed(Exception):
    """A reply that breaks the door's protocol (the message says how)."""


def _timed_out(door: Path, timeout: float) -> DoorError:
    return DoorError(f"the agent's door {door} did not answer within {timeout:g} s")


def _malformed(door: Path, file_id: int, what: str) -> DoorError:
    return DoorError(f"the agent's door {door} sent a malformed reply for file {file_id}: {what}")


def _settimeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _receive(sock: socket.socket, deadline: float) -> tuple[bytes, list[int]]:
    """The reply line and the descriptors that came with it (each closed if this raises).

    ``recvmsg`` itself, not :func:`socket.recv_fds`: Python 3.11's passes no flags, and
    ``MSG_CMSG_CLOEXEC`` keeps a descriptor from leaking into a process vLLM executes.
    """
    data = b""
    fds: list[int] = []
    try:
        while b"\n" not in data:
            if len(data) >= DOOR_REQUEST_BYTES:
                raise _Malformed(f"longer than {DOOR_REQUEST_BYTES} bytes")
            _settimeout(sock, deadline)
            chunk, ancillary, flags, _ = sock.recvmsg(
                DOOR_REQUEST_BYTES, socket.CMSG_SPACE(_MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
            )
            fds.extend(_descriptors(ancillary))
            if flags & socket.MSG_CTRUNC:
                raise _Malformed(f"more than {_MAX_FDS} descriptors")
            if not chunk:
                raise OSError("no reply")
            data += chunk
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return data, fds


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _granted(door: Path, file_id: int, data: bytes, fds: list[int]) -> ChunkFile:
    """The chunk file of a reply, checked; :class:`DoorError` if refused or malformed."""
    line, _, rest = data.partition(b"\n")
    try:
        reply = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _malformed(door, file_id, "not a line of JSON") from None
    if rest or not isinstance(reply, dict):
        raise _malformed(door, file_id, "not one JSON object")
    if "error" in reply:
        reason = " ".join(str(reply["error"]).split())[:_ERROR_CHARS]
        raise DoorError(f"the agent's door {door} refused file {file_id}: {reason}")
    granted, owner, writable = reply.get("file"), reply.get("owner"), reply.get("writable")
    of_this_file = type(granted) is int and granted == file_id
    if not (of_this_file and isinstance(owner, str) and isinstance(writable, bool)):
        raise _malformed(door, file_id, "not a grant of this file")
    if len(fds) != 1:
        raise _malformed(door, file_id, f"{len(fds)} descriptors, not one")
    (fd,) = fds
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_ino != file_id:
        raise _malformed(
            door, file_id, f"the descriptor is not of a regular file with inode {file_id}"
        )
    access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    if access != (os.O_RDWR if writable else os.O_RDONLY):
        raise _malformed(door, file_id, "the descriptor is not open as the grant says")
    return ChunkFile(fd, owner, writable, file_id)


def _reason(error: OSError) -> str:
    return error.strerror or str(error)
