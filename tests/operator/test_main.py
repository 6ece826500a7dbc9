"""The ``kvpool-operator`` command line."""

from __future__ import annotations

import pytest

from kvpool_operator.main import main


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
