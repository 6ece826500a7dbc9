"""The ``kvpool-operator`` command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool_operator.main import main
from tests.support.mistakes import BIN, Mistake, feed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--namespace", "x"], "--agent-image or $KVPOOL_AGENT_IMAGE is required"),
        (["--agent-image", "kvpool:1"], "one of the arguments -n/--namespace -A/--all-namespaces"),
        (["-A", "-n", "x", "--agent-image", "i"], "not allowed with argument"),
    ],
)
def test_refuses_an_incomplete_command_line(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVPOOL_AGENT_IMAGE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


IMAGE = ["-A", "--agent-image", "kvpool:1"]

OPERATOR = [
    Mistake(
        "no-scope",
        ["--agent-image", "kvpool:1"],
        ["kvpool-operator: one of the arguments -n/--namespace -A/--all-namespaces is required"],
    ),
    Mistake(
        "no-image", ["-A"], ["kvpool-operator: --agent-image or $KVPOOL_AGENT_IMAGE is required"]
    ),
    Mistake(
        "both-scopes",
        [*IMAGE, "-n", "x"],
        ["kvpool-operator: argument -n/--namespace: not allowed with argument -A/--all-namespaces"],
    ),
    Mistake(
        "retry-seconds",
        [*IMAGE, "--retry-seconds", "-1"],
        ["kvpool-operator: argument --retry-seconds: expected a number above 0, not -1"],
    ),
    Mistake(
        "usage-seconds",
        [*IMAGE, "--usage-seconds", "soon"],
        ["kvpool-operator: argument --usage-seconds: expected a number, not 'soon'"],
    ),
    Mistake(
        "clear-retries",
        [*IMAGE, "--clear-retries", "1.5"],
        ["kvpool-operator: argument --clear-retries: expected a whole number, not '1.5'"],
    ),
    Mistake(
        "liveness",
        [*IMAGE, "--liveness", "0.0.0.0:8080"],
        [
            "kvpool-operator: argument --liveness: expected http://HOST:PORT/PATH, "
            "not '0.0.0.0:8080'"
        ],
    ),
    Mistake(
        "log-format",
        [*IMAGE, "--log-format", "xml"],
        ["kvpool-operator: argument --log-format: invalid choice: 'xml'"],
    ),
    Mistake(
        "unknown-flag", [*IMAGE, "--frob"], ["kvpool-operator: unrecognized arguments: --frob"]
    ),
]


@pytest.mark.parametrize("mistake", OPERATOR, ids=str)
def test_broken_command_lines_are_one_line_each(mistake: Mistake, tmp_path: Path) -> None:
    feed(f"{BIN}/kvpool-operator", mistake, tmp_path)
