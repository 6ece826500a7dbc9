"""The agent's door: real Unix sockets, real files, a real token authority.

Each test serves a door (:class:`~kvpool.agent.edge.door.DoorServer`) over a few chunk
files in ``tmp_path`` and asks it as a connector does (:func:`~kvpool.common.door.open_chunk_file`)
or byte by byte (:func:`exchange`): who gets which file, read-write or read-only; what
each refusal says; that no descriptor leaks; and what stalled strangers cost a real client.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.agent.edge.door import DoorServer, Refusal
from kvpool.common.auth import Principal, TokenAuthority
from kvpool.common.door import (
    DOOR_REQUEST_BYTES,
    ChunkFile,
    DoorError,
    grant_line,
    open_chunk_file,
    request_line,
)
from kvpool.common.files import FileRefused
from kvpool.common.keys import CANARY_TENANT, tenant_id
from kvpool.common.names import DOOR_DIRECTORY, DOOR_SOCKET
from kvpool.common.tenants_configmap import digest_token
from tests.support.local_user import NOBODY, needs_root
from tests.support.polling import wait_until

ALICE, BOB, CAROL, SPACE = (tenant_id(name) for name in ("alice", "bob", "carol", "space"))
TOKENS = {
    "admin": "admin-token",
    "engines": "engine-token",
    "indexes": "index-token",
    "gateways": "gateway-token",
    "tenants": {ALICE: "alice-token", BOB: "bob-token"},
    "spaces": {SPACE: {"members": [ALICE]}},
}
FILE_BYTES = 1 << 16
CLIENT_BOUND = 1.0
"""The longest a real client may wait for its file while strangers flood the door."""


class ChunkFiles:
    """A :class:`~kvpool.agent.edge.door.ChunkFileSource` over files in a directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.by_id: dict[int, tuple[str, Path]] = {}
        root.mkdir()

    def add(self, owner: str) -> int:
        path = self.root / owner
        path.write_bytes(owner.encode())
        os.truncate(path, FILE_BYTES)  # sparse, as the agent's are
        file_id = os.stat(path).st_ino
        self.by_id[file_id] = (owner, path)
        return file_id

    def path(self, file_id: int) -> Path:
        return self.by_id[file_id][1]

    def chunk_file(self, file_id: int) -> tuple[str, Path] | None:
        return self.by_id.get(file_id)


@pytest.fixture
def authority() -> TokenAuthority:
    return TokenAuthority(TOKENS)


@pytest.fixture
def files(tmp_path: Path) -> ChunkFiles:
    files = ChunkFiles(tmp_path / "chunks")
    for owner in (ALICE, BOB, SPACE, CANARY_TENANT):
        files.add(owner)
    return files


def id_of(files: ChunkFiles, owner: str) -> int:
    return next(file_id for file_id, (known, _) in files.by_id.items() if known == owner)


@pytest.fixture
def serve(
    tmp_path: Path, authority: TokenAuthority, files: ChunkFiles
) -> Iterator[Callable[..., DoorServer]]:
    """Start a door at ``tmp_path/door/agent.sock`` (keywords: DoorServer's); closed after."""
    servers: list[DoorServer] = []

    def start(**options: Any) -> DoorServer:
        server = DoorServer(
            tmp_path / DOOR_DIRECTORY / DOOR_SOCKET,
            authority,
            files,
            **options,
        )
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def door(serve: Callable[..., DoorServer]) -> DoorServer:
    return serve()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def exchange(path: Path, payload: bytes, timeout: float = 5.0) -> tuple[dict[str, object], int]:
    """Send ``payload`` raw; the reply and how many descriptors came with it (closed), once
    the door closed the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(payload)
        data, fds = b"", 0
        while True:
            try:
                chunk, ancillary, _, _ = sock.recvmsg(8192, socket.CMSG_SPACE(16))
            except ConnectionResetError:  # closed with some of a long request unread
                break
            for _, _, descriptors in ancillary:
                for index in range(0, len(descriptors), 4):
                    os.close(int.from_bytes(descriptors[index : index + 4], "little"))
                    fds += 1
            if not chunk:
                break
            data += chunk
    assert data.endswith(b"\n") and data.count(b"\n") == 1, data
    return json.loads(data), fds


def refusal(path: Path, payload: bytes) -> str:
    """The door's one-line refusal of ``payload``: no descriptor came with it."""
    reply, fds = exchange(path, payload)
    assert fds == 0 and set(reply) == {"error"}, reply
    error = reply["error"]
    assert isinstance(error, str) and "\n" not in error and error
    return error


# ---------------------------------------------------------------- who gets what


def test_a_tenant_maps_its_own_file_read_write(door: DoorServer, files: ChunkFiles) -> None:
    file_id = id_of(files, ALICE)
    chunk = open_chunk_file(door.path, "alice-token", file_id)
    try:
        assert chunk == ChunkFile(chunk.fd, ALICE, True, file_id)
        assert not os.get_inheritable(chunk.fd)  # close-on-exec: no leak into vLLM's children
        mapping = mmap.mmap(chunk.fd, FILE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mapping[4096:4101] = b"hello"
        mapping.close()
    finally:
        chunk.close()
    assert files.path(file_id).read_bytes()[4096:4101] == b"hello"
    wait_until(lambda: door.stats.granted == 1)


def test_a_member_maps_a_space_read_only(door: DoorServer, files: ChunkFiles) -> None:
    file_id = id_of(files, SPACE)
    chunk = open_chunk_file(door.path, "alice-token", file_id)
    try:
        assert (chunk.owner, chunk.writable, chunk.file_id) == (SPACE, False, file_id)
        with pytest.raises(PermissionError):
            mmap.mmap(chunk.fd, FILE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError) as caught:
            os.pwrite(chunk.fd, b"x", 0)
        assert caught.value.errno == errno.EBADF
        reading = mmap.mmap(chunk.fd, FILE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        assert reading[: len(SPACE)] == SPACE.encode()
        reading.close()
    finally:
        chunk.close()
    assert files.path(file_id).read_bytes()[: len(SPACE)] == SPACE.encode()


@pytest.mark.parametrize(
    ("token", "owner", "writable"),
    [
        ("engine-token", ALICE, True),
        ("engine-token", SPACE, True),
        ("admin-token", BOB, True),
        ("bob-token", CANARY_TENANT, True),
        ("alice-token", CANARY_TENANT, True),
        ("bob-token", BOB, True),
    ],
)
def test_who_maps_which_file(
    door: DoorServer, files: ChunkFiles, token: str, owner: str, writable: bool
) -> None:
    chunk = open_chunk_file(door.path, token, id_of(files, owner))
    chunk.close()
    assert (chunk.owner, chunk.writable) == (owner, writable)


def test_another_tenants_file_is_refused_and_nothing_leaks(
    door: DoorServer, files: ChunkFiles
) -> None:
    before = open_fds()
    for _ in range(20):
        with pytest.raises(DoorError) as caught:
            open_chunk_file(door.path, "bob-token", id_of(files, ALICE))
        message = str(caught.value)
        assert message == (
            f"the agent's door {door.path} refused file {id_of(files, ALICE)}: this token acts "
            f"for tenant {BOB} and may not map file {id_of(files, ALICE)}"
        )
        assert ALICE not in message  # whose file it is stays unsaid
        with pytest.raises(DoorError, match=f"tenant {BOB} and may not map"):
            open_chunk_file(door.path, "bob-token", id_of(files, SPACE))  # not a member
    wait_until(lambda: open_fds() == before, what="the process's descriptors back as before")
    assert door.stats.refused[Refusal.FORBIDDEN] == 40


@pytest.mark.parametrize("token", ["index-token", "gateway-token"])
def test_an_index_or_a_gateway_maps_nothing(
    door: DoorServer, files: ChunkFiles, token: str
) -> None:
    role = token.split("-", maxsplit=1)[0]
    with pytest.raises(DoorError, match=f"a token of the {role} role may map no chunk file$"):
        open_chunk_file(door.path, token, id_of(files, CANARY_TENANT))


def test_a_revoked_token_maps_nothing_more(
    door: DoorServer, files: ChunkFiles, authority: TokenAuthority
) -> None:
    carol = files.add(CAROL)
    authority.replace_granted([(digest_token("carol-token"), Principal.for_tenant(CAROL))])
    open_chunk_file(door.path, "carol-token", carol).close()
    authority.replace_granted([])
    with pytest.raises(DoorError, match=r"unknown token$"):
        open_chunk_file(door.path, "carol-token", carol)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b'{"token": "nobody", "file": 7}\n', "unknown token"),
        (b"{nope\n", "the request is not a line of JSON"),
        (b"\xff\xfe\n", "the request is not a line of JSON"),
        (b"[" * 4000 + b"\n", "the request is not a line of JSON"),
        (b"[1, 2]\n", "the request is an array, not a JSON object"),
        (b'{"file": 7}\n', "the request has no 'token' field"),
        (b'{"token": "alice-token"}\n', "the request has no 'file' field"),
        (b'{"token": 42, "file": 7}\n', "'token' must be a string, not an integer"),
        (b'{"token": "t", "file": "7"}\n', "'file' must be an integer (a file id), not a string"),
        (b'{"token": "t", "file": true}\n', "'file' must be an integer (a file id), not a boolean"),
        (b'{"token": "t", "file": 7.0}\n', "'file' must be an integer (a file id), not a number"),
        (
            b'{"token": "t", "file": 0}\n',
            "'file' must be a file id, an integer from 1 to 2**64 - 1",
        ),
        (
            b'{"token": "t", "file": 18446744073709551616}\n',
            "'file' must be a file id, an integer from 1 to 2**64 - 1",
        ),
        (b"x" * 5000, f"the request is longer than {DOOR_REQUEST_BYTES} bytes"),
        (b"x" * DOOR_REQUEST_BYTES, f"the request is longer than {DOOR_REQUEST_BYTES} bytes"),
    ],
)
def test_a_bad_request_gets_one_clear_line(door: DoorServer, payload: bytes, error: str) -> None:
    assert refusal(door.path, payload) == error


def test_a_misplaced_token_is_never_echoed(door: DoorServer) -> None:
    for payload in (
        b'{"token": ["alice-token"], "file": 7}\n',
        b'{"token": "t", "file": "alice-token"}\n',
    ):
        assert "alice-token" not in refusal(door.path, payload)


def test_a_request_of_exactly_the_bound_is_served(door: DoorServer, files: ChunkFiles) -> None:
    line = request_line("alice-token", id_of(files, ALICE))
    padded = line[:-2] + b" " * (DOOR_REQUEST_BYTES - len(line)) + line[-2:]
    assert len(padded) == DOOR_REQUEST_BYTES
    reply, fds = exchange(door.path, padded)
    assert (reply.get("owner"), fds) == (ALICE, 1)


def test_the_client_names_the_door_and_the_reason(door: DoorServer, files: ChunkFiles) -> None:
    with pytest.raises(DoorError) as caught:
        open_chunk_file(door.path, "nobody", id_of(files, ALICE))
    assert str(caught.value) == (
        f"the agent's door {door.path} refused file {id_of(files, ALICE)}: unknown token"
    )
    # an id no file has is refused in the words of a file the token may not map
    with pytest.raises(DoorError, match=r"refused file 12345: .* may not map file 12345$"):
        open_chunk_file(door.path, "alice-token", 12345)
    with pytest.raises(DoorError, match="the token is too long"):
        open_chunk_file(door.path, "t" * DOOR_REQUEST_BYTES, 1)
    absent = door.path.with_name("absent.sock")
    with pytest.raises(DoorError, match=f"^cannot reach the agent's door {absent}: No such file"):
        open_chunk_file(absent, "alice-token", 1)


@pytest.mark.parametrize("replacement", ["file", "link"])
def test_a_file_no_longer_at_its_path_is_gone(
    door: DoorServer, files: ChunkFiles, tmp_path: Path, replacement: str
) -> None:
    file_id = id_of(files, ALICE)
    path = files.path(file_id)
    moved = tmp_path / "moved"
    os.rename(path, moved)
    if replacement == "file":
        path.write_bytes(b"another file")
    else:
        path.symlink_to(moved)  # the very file, behind a link: not followed
    with pytest.raises(DoorError, match=f"refused file {file_id}: chunk file {file_id} is gone$"):
        open_chunk_file(door.path, "alice-token", file_id)
    path.unlink()
    with pytest.raises(DoorError, match=f"chunk file {file_id} is gone$"):
        open_chunk_file(door.path, "alice-token", file_id)
    assert door.stats.refused[Refusal.GONE] == 2


def test_a_flood_of_refusals_is_one_log_line_a_kind(
    door: DoorServer, files: ChunkFiles, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvpool.agent.edge.door"):
        for _ in range(50):
            with pytest.raises(DoorError):
                open_chunk_file(door.path, "secret-token-1", id_of(files, ALICE))
            with pytest.raises(DoorError):
                open_chunk_file(door.path, "bob-token", id_of(files, ALICE))
        wait_until(lambda: sum(door.stats.refused.values()) == 100)
    lines = [record for record in caplog.records if record.name == "kvpool.agent.edge.door"]
    assert [record.getMessage() for record in lines] == [
        "door: refused a request with an unknown token",
        "door: refused a token a chunk file it may not map",
    ]
    assert all(record.levelno <= logging.INFO for record in lines)
    assert "secret-token" not in caplog.text


# ---------------------------------------------------------------- strangers


def test_stalled_strangers_do_not_keep_out_a_client(
    serve: Callable[..., DoorServer], files: ChunkFiles
) -> None:
    door = serve(max_pending=64)
    strangers: list[socket.socket] = []
    served: list[float] = []
    most = 0

    def stall(count: int) -> None:
        nonlocal most
        for index in range(count):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(door.path))
            if index % 3 == 0:
                sock.send(b"{")  # a trickle that never ends its line
            strangers.append(sock)
            most = max(most, door.open_connections)

    try:
        stall(300)
        for _ in range(5):
            stall(60)
            started = time.monotonic()
            open_chunk_file(door.path, "alice-token", id_of(files, ALICE), timeout=5).close()
            served.append(time.monotonic() - started)
            most = max(most, door.open_connections)
        assert max(served) < CLIENT_BOUND, served
        assert most <= 64
        wait_until(lambda: door.stats.refused[Refusal.EVICTED] >= 600 - 64)
        assert door.open_connections <= 64
        wait_until(lambda: door.stats.granted == 5)
        # the oldest strangers were closed, each told why
        strangers[1].settimeout(5)  # (one that sent nothing: no reset for unread bytes)
        assert json.loads(strangers[1].recv(4096)) == {"error": "the door is busy; try again"}
        assert strangers[1].recv(4096) == b""
    finally:
        for sock in strangers:
            sock.close()


def closed_after(sock: socket.socket, trickle: bool, bound: float = 5.0) -> tuple[float, bytes]:
    """Seconds until the door closes ``sock`` (a byte sent every 50 ms if ``trickle``), and
    what it said before."""
    started = time.monotonic()
    received = b""
    sock.settimeout(0.05)
    while time.monotonic() - started < bound:
        with contextlib.suppress(OSError):
            if trickle:
                sock.send(b" ")
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return time.monotonic() - started, received
        received += chunk
    raise AssertionError(f"the door did not close a stalled connection within {bound} s")


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "trickling"])
def test_a_stalled_connection_is_closed_after_its_seconds(
    serve: Callable[..., DoorServer], trickle: bool
) -> None:
    door = serve(seconds=0.3)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(door.path))
        wait_until(lambda: door.open_connections == 1)
        seconds, said = closed_after(sock, trickle)
    assert 0.25 <= seconds < 3.0
    assert json.loads(said) == {"error": "no request within 0.3 s"}
    wait_until(lambda: door.open_connections == 0)
    assert door.stats.refused[Refusal.TIMEOUT] == 1


# ---------------------------------------------------------------- the socket


def test_the_socket_is_for_anyone_in_a_directory_of_the_agent(door: DoorServer) -> None:
    assert stat.S_ISSOCK(os.lstat(door.path).st_mode)
    assert stat.S_IMODE(os.lstat(door.path).st_mode) == 0o666
    assert stat.S_IMODE(os.lstat(door.path.parent).st_mode) == 0o755
    door.close()
    assert not os.path.lexists(door.path)


def test_a_path_held_by_a_file_is_refused(
    tmp_path: Path, authority: TokenAuthority, files: ChunkFiles
) -> None:
    path = tmp_path / DOOR_DIRECTORY / DOOR_SOCKET
    path.parent.mkdir(mode=0o755)
    path.write_bytes(b"not a socket")
    before = open_fds()
    with pytest.raises(FileRefused) as caught:
        DoorServer(path, authority, files).start()
    assert str(caught.value).startswith(f"refusing door socket {path}: it is a regular file (")
    assert path.read_bytes() == b"not a socket"
    assert open_fds() == before  # a door that failed to start holds nothing


def stale_socket(path: Path) -> None:
    """A socket at ``path`` that nobody serves (its agent ended without removing it)."""
    path.parent.mkdir(mode=0o755, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


def test_a_stale_socket_of_ours_is_replaced(
    tmp_path: Path, serve: Callable[..., DoorServer], files: ChunkFiles
) -> None:
    path = tmp_path / DOOR_DIRECTORY / DOOR_SOCKET
    stale_socket(path)
    with pytest.raises(DoorError, match="Connection refused"):
        open_chunk_file(path, "alice-token", id_of(files, ALICE))
    serve()
    open_chunk_file(path, "alice-token", id_of(files, ALICE)).close()


def test_a_served_socket_is_not_taken_over(
    serve: Callable[..., DoorServer], files: ChunkFiles, authority: TokenAuthority
) -> None:
    door = serve()
    with pytest.raises(FileRefused, match=f"refusing door socket {door.path}: another process"):
        DoorServer(door.path, authority, files).start()
    open_chunk_file(door.path, "alice-token", id_of(files, ALICE)).close()


@pytest.mark.root
@needs_root
def test_another_users_socket_is_refused(
    tmp_path: Path, authority: TokenAuthority, files: ChunkFiles
) -> None:
    path = tmp_path / DOOR_DIRECTORY / DOOR_SOCKET
    stale_socket(path)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(FileRefused, match="it belongs to another user"):
        DoorServer(path, authority, files).start()
    assert os.lstat(path).st_uid == NOBODY


def test_close_leaves_a_socket_that_replaced_its_own(door: DoorServer) -> None:
    door.path.unlink()
    stale_socket(door.path)
    door.close()
    assert stat.S_ISSOCK(os.lstat(door.path).st_mode)


# ---------------------------------------------------------------- the client's checks


def fake_door(path: Path, reply: bytes, fds: list[int]) -> threading.Thread:
    """A door that answers one request with ``reply`` and ``fds`` (closed once sent)."""
    path.parent.mkdir(exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()

    def answer() -> None:
        with listener, listener.accept()[0] as sock:
            sock.recv(DOOR_REQUEST_BYTES)
            ancillary = (
                [
                    (
                        socket.SOL_SOCKET,
                        socket.SCM_RIGHTS,
                        b"".join(fd.to_bytes(4, "little") for fd in fds),
                    )
                ]
                if fds
                else []
            )
            sock.sendmsg([reply], ancillary)
            for fd in fds:
                os.close(fd)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("another file", "the descriptor is not of a regular file with inode"),
        ("two descriptors", "2 descriptors, not one"),
        ("five descriptors", "more than 4 descriptors"),
        ("too long", f"longer than {DOOR_REQUEST_BYTES} bytes"),
        ("no descriptor", "0 descriptors, not one"),
        ("read-only claimed writable", "the descriptor is not open as the grant says"),
        ("another id", "not a grant of this file"),
        ("not JSON", "not a line of JSON"),
    ],
)
def test_the_client_checks_what_it_is_handed(
    tmp_path: Path, files: ChunkFiles, case: str, reason: str
) -> None:
    before = open_fds()
    file_id = id_of(files, ALICE)
    path, other = files.path(file_id), files.path(id_of(files, BOB))
    reply = grant_line(file_id, ALICE, True)
    if case == "another file":
        fds = [os.open(other, os.O_RDWR)]
    elif case in ("two descriptors", "five descriptors"):
        fds = [os.open(path, os.O_RDWR) for _ in range(2 if case == "two descriptors" else 5)]
    elif case == "too long":
        fds, reply = [os.open(path, os.O_RDWR)], b" " * 5000 + reply
    elif case == "no descriptor":
        fds = []
    elif case == "read-only claimed writable":
        fds = [os.open(path, os.O_RDONLY)]
    else:
        fds = [os.open(path, os.O_RDWR)]
        reply = grant_line(file_id + 1, ALICE, True) if case == "another id" else b"{\n"
    door = tmp_path / "fake" / "agent.sock"
    thread = fake_door(door, reply, fds)
    with pytest.raises(DoorError, match=f"sent a malformed reply for file {file_id}: {reason}"):
        open_chunk_file(door, "alice-token", file_id)
    thread.join()  # the fake door closed its own descriptors
    assert open_fds() == before


def test_the_client_gives_up_at_its_timeout(tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()
        started = time.monotonic()
        with pytest.raises(
            DoorError, match=f"^the agent's door {path} did not answer within 0.2 s$"
        ):
            open_chunk_file(path, "alice-token", 1, timeout=0.2)
        assert time.monotonic() - started < 2.0
