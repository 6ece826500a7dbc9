"""Broken inputs fed to a console script, and its one-line refusals on stderr.

Each :class:`Mistake` is one row of a script's table: the command line, environment
variables and files, and the lines the script must print on stderr, one per problem. The
script must exit 2 and print exactly those lines (each line starts with the expected text;
the rest is pydantic's or the OS's wording), no traceback, nothing else.

:func:`refuse` runs a row through the script's ``main(argv)`` in the test's process (a
table's rows cost milliseconds each); :func:`feed` runs it as a user does, a real process
(a few rows per script, and what only a process shows: a port held, a second instance).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Mistake:
    id: str
    argv: list[str]
    lines: list[str]
    """What each line of stderr starts with, in order; ``{tmp}`` is the test's directory and
    ``{port}`` a port that another socket holds."""
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    """Written into the test's directory before the script runs: name, content (a lone
    surrogate such as ``\\udcff`` is that byte)."""

    def __str__(self) -> str:
        return self.id


@contextmanager
def held_port() -> Iterator[int]:
    """A loopback port that a listening socket holds while the block runs."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        yield int(holder.getsockname()[1])


def clean_environment(tmp_path: Path) -> dict[str, str]:
    """This process's environment without kvpool's variables and without a way to this
    machine's Kubernetes cluster (``KUBECONFIG``, a pod's ``KUBERNETES_*``), with a home of
    its own."""
    kept = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("KVPOOL_", "KUBERNETES_")) and name != "KUBECONFIG"
    }
    return {**kept, "HOME": str(tmp_path)}


def feed(
    script: str,
    mistake: Mistake,
    tmp_path: Path,
    env: dict[str, str] | None = None,
    port: int = 0,
) -> list[str]:
    """Run ``script`` with ``mistake``; assert its one-line refusals; return its stderr lines."""
    fill = _written(mistake, tmp_path, port)
    environment = {
        **clean_environment(tmp_path),
        **(env or {}),
        **{name: fill(value) for name, value in mistake.env.items()},
    }
    result = subprocess.run(
        [*script.split(), *(fill(argument) for argument in mistake.argv)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return _refused(result.stderr, result.returncode, [fill(line) for line in mistake.lines])


def refuse(
    main: Callable[[Sequence[str]], object],
    mistake: Mistake,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> list[str]:
    """:func:`feed` in this process: ``main(argv)`` of the script's module, with the same
    environment (``os.environ`` as it was once it returns) and files."""
    fill = _written(mistake, tmp_path, 0)
    environment = {
        **clean_environment(tmp_path),
        **{name: fill(value) for name, value in mistake.env.items()},
    }
    capsys.readouterr()
    code: object
    with mock.patch.dict(os.environ, environment, clear=True):
        try:
            code = main([fill(argument) for argument in mistake.argv])
        except SystemExit as exit:
            code = exit.code
    stderr = capsys.readouterr().err
    if isinstance(code, str):  # what the interpreter does with SystemExit("...")
        stderr, code = f"{stderr}{code}\n", 1
    return _refused(stderr, code, [fill(line) for line in mistake.lines])


def _written(mistake: Mistake, tmp_path: Path, port: int) -> Callable[[str], str]:
    """Write the mistake's files; return how its texts are filled in."""

    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace("{port}", str(port))

    for name, content in mistake.files.items():
        (tmp_path / name).write_bytes(fill(content).encode("utf-8", "surrogateescape"))
    return fill


def _refused(stderr: str, code: object, expected: list[str]) -> list[str]:
    """Exit status 2 and exactly the ``expected`` lines on stderr, no traceback."""
    lines = stderr.splitlines()
    assert "Traceback" not in stderr, stderr
    assert code == 2, stderr
    assert len(lines) == len(expected), stderr
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(start), f"{line!r} does not start with {start!r}"
    return lines
