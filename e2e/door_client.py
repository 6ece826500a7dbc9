"""What a team's pod reaches of the agent's door, wired by the label: ``argv[1:]`` are
``name=file id`` pairs (chunk files of the node's agent); for each, what the door at
``KVPOOL_CONNECTOR_DOOR_PATH`` gives this pod's token (``KVPOOL_CONNECTOR_TOKEN``, from its
team's Secret), and what the pod's kvpool volume holds, printed as JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvpool.common.door import DoorError, open_chunk_file


def main() -> None:
    door = Path(os.environ["KVPOOL_CONNECTOR_DOOR_PATH"])
    token = os.environ["KVPOOL_CONNECTOR_TOKEN"]
    answers: dict[str, dict[str, object]] = {}
    for pair in sys.argv[1:]:
        name, file_id = pair.split("=")
        try:
            granted = open_chunk_file(door, token, int(file_id))
        except DoorError as error:
            answers[name] = {"refused": str(error)}
            continue
        granted.close()
        answers[name] = {"owner": granted.owner, "writable": granted.writable}
    print(json.dumps({"volume": sorted(os.listdir(door.parent)), "files": answers}))


if __name__ == "__main__":
    main()
