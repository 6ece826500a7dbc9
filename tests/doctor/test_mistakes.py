"""``kvpool doctor`` given broken inputs: one line per problem, naming the flag or variable
as written and its value; exit 2. The table runs through ``kvpool``'s ``main(argv)`` in the
test's process; one row also as a user runs it, a real process."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from kvpool.tools import cli
from tests.support.mistakes import BIN, Mistake, feed, refuse

ENDPOINT = ["--endpoint", "tcp://127.0.0.1:7400"]

DOCTOR = [
    Mistake(
        "endpoint-without-tcp",
        ["--endpoint", "127.0.0.1:7400"],
        [
            "kvpool doctor: --endpoint 127.0.0.1:7400: must be tcp://host:port or ipc://path; "
            "did you mean tcp://127.0.0.1:7400?"
        ],
    ),
    Mistake(
        "no-target",
        [],
        ["kvpool doctor: one of the arguments --endpoint --pool is required"],
    ),
    Mistake(
        "env-endpoint",
        ENDPOINT,  # with --pool the doctor reads the pool's Service, whatever the variable
        [
            "kvpool doctor: KVPOOL_CONNECTOR_ENDPOINT=localhost:7400: must be tcp://host:port or ipc://path"
        ],
        env={"KVPOOL_CONNECTOR_ENDPOINT": "localhost:7400"},
    ),
    Mistake(
        "env-chunk-tokens",
        ENDPOINT,
        ["kvpool doctor: KVPOOL_CONNECTOR_CHUNK_TOKENS=many: input should be a valid integer"],
        env={"KVPOOL_CONNECTOR_CHUNK_TOKENS": "many"},
    ),
    Mistake(
        "timeout",
        [*ENDPOINT, "--timeout", "0"],
        ["kvpool doctor: argument --timeout: expected a number above 0, not 0"],
    ),
    Mistake(
        "block-size",
        [*ENDPOINT, "--block-size", "x"],
        ["kvpool doctor: argument --block-size: expected a whole number, not 'x'"],
    ),
    Mistake(
        "http-without-scheme",
        [*ENDPOINT, "--http", "localhost:7401"],
        ["kvpool doctor: argument --http: expected http://HOST:PORT, not 'localhost:7401'"],
    ),
    Mistake(
        "admin-token-file",
        [*ENDPOINT, "--admin-token-file", "{tmp}/absent"],
        [
            "kvpool doctor: --admin-token-file {tmp}/absent: cannot read it: "
            "No such file or directory"
        ],
    ),
    Mistake(
        "model-config-absent",
        [*ENDPOINT, "--model-config", "{tmp}/absent.json"],
        [
            "kvpool doctor: --model-config {tmp}/absent.json: cannot read it: "
            "No such file or directory"
        ],
    ),
    Mistake(
        "model-directory-without-config",
        [*ENDPOINT, "--model-config", "{tmp}"],
        [
            "kvpool doctor: --model-config {tmp}/config.json: cannot read it: "
            "No such file or directory"
        ],
    ),
    Mistake(
        "model-config-not-json",
        [*ENDPOINT, "--model-config", "{tmp}"],
        ["kvpool doctor: --model-config {tmp}/config.json: not JSON: Expecting"],
        files={"config.json": '{"model_type": "llama",'},
    ),
    Mistake(
        "model-config-not-an-object",
        [*ENDPOINT, "--model-config", "{tmp}/config.json"],
        [
            "kvpool doctor: --model-config {tmp}/config.json: not a model's config.json "
            "(a JSON object, not list)"
        ],
        files={"config.json": "[]"},
    ),
]


def doctor(argv: Sequence[str]) -> int:
    """``kvpool doctor ARGV``, in this process."""
    return cli.main(["doctor", *argv])


@pytest.mark.parametrize("mistake", DOCTOR, ids=str)
def test_doctor(mistake: Mistake, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refuse(doctor, mistake, tmp_path, capsys)


@pytest.mark.process
def test_the_script_refuses_in_one_line(tmp_path: Path) -> None:
    feed(f"{BIN}/kvpool doctor", DOCTOR[2], tmp_path)  # a variable's value: read at start
