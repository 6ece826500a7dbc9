"""The commands page: every console script's ``--help``, and each subcommand's, as the
installed scripts print it (80 columns)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points

DISTRIBUTION = "kvpool"
SCRIPTS = (
    "kvpool-agent",
    "kvpool-operator",
    "kvpool-csi",
    "kvpool-index",
    "kvpool-pd-sidecar",
    "kvpool",
)
"""The console scripts, in the page's order (each one of pyproject's [project.scripts])."""
_CHOICES = re.compile(r"^  \{([a-z0-9,-]+)\}", re.MULTILINE)


def script(name: str) -> list[str]:
    """The command line that runs console script ``name`` with this interpreter, from its
    entry point (so a module that moves needs no change here)."""
    (point,) = [
        point
        for point in entry_points(group="console_scripts", name=name)
        if point.dist is None or point.dist.name == DISTRIBUTION
    ]
    module, _, attribute = point.value.partition(":")
    code = (
        f"import sys; from {module} import {attribute} as m; sys.argv[0] = {name!r}; sys.exit(m())"
    )
    return [sys.executable, "-c", code]


def help_text(argv: list[str]) -> str:
    """``argv --help``, as a terminal of 80 columns shows it."""
    environment = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}
    environment.pop("FORCE_COLOR", None)
    done = subprocess.run(
        [*script(argv[0]), *argv[1:], "--help"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} --help exited {done.returncode}: {done.stderr}")
    return done.stdout.rstrip()


def commands(argv: list[str]) -> list[tuple[list[str], str]]:
    """``argv`` and each subcommand under it, depth first, with its help."""
    text = help_text(argv)
    found = [(argv, text)]
    options = text.split("positional arguments:", 1)
    choices = _CHOICES.search(options[1]) if len(options) == 2 else None
    for sub in choices[1].split(",") if choices else ():
        found += commands([*argv, sub])
    return found


def render() -> str:
    parts: list[str] = []
    for name in SCRIPTS:
        for argv, text in commands([name]):
            parts += [
                "#" * min(len(argv) + 1, 4) + f" `{' '.join(argv)}`",
                "",
                "```text",
                text,
                "```",
                "",
            ]
    return "\n".join(parts).rstrip()
