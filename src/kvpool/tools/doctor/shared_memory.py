"""The door check: this pod reaches the agent's door, which hands out the chunk files its
token may map.

Where it cannot, the connector moves KV through the agent's messages instead (slower), so
that finding is a WARN, with the fix. The connector asks the door its settings name
(``door_path``), else the one beside its ``segment_path``, else the one the agent's hello
names.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from kvpool.common.names import CONNECTOR_DOOR_PATH_ENV
from kvpool.tools.doctor.report import Check, passed, warned

DOOR = "door"

OTHER_FILE = (
    "this pod must map the chunk files the agent's door gives it: drop a door_path / "
    f"{CONNECTOR_DOOR_PATH_ENV} that names another agent's door"
)
_CONNECT_SECONDS = 2.0
_GIVE_THE_DOOR = (
    "label the pod for the pool (kvpool's admission webhook gives it the agent's door, a "
    f"CSI volume), or set door_path / {CONNECTOR_DOOR_PATH_ENV} where it is mounted"
)


def check_door(door: Path | None) -> Check:
    """Whether ``door`` (None: the transport ``messages``) is a socket this pod reaches and
    someone answers at (a connection, closed at once: the door asks nothing of it)."""
    if door is None:
        return passed(DOOR, "not used (transport=messages): this pod maps no chunk file")
    try:
        found = door.stat()
    except OSError as error:
        return warned(DOOR, f"{door}: {error.strerror} in this pod", _GIVE_THE_DOOR)
    if not stat.S_ISSOCK(found.st_mode):
        return warned(
            DOOR, f"{door} is not a socket (mode {stat.filemode(found.st_mode)})", _GIVE_THE_DOOR
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_CONNECT_SECONDS)
        try:
            probe.connect(os.fsdecode(door))
        except OSError as error:
            return warned(
                DOOR,
                f"{door}: nobody answers there ({error.strerror or error})",
                "the agent that left it has stopped: start it, or name the running agent's "
                f"door (door_path / {CONNECTOR_DOOR_PATH_ENV})",
            )
    return passed(DOOR, f"{door}: the agent's door, which gives this pod's token its chunk files")
