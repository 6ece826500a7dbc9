"""The architecture diagram of ``docs/architecture.md``, drawn from the import contracts.

``python -m tests.support.architecture --write`` puts a mermaid flowchart between the
markers of ``docs/architecture.md``; ``--check`` (and ``tests/packaging``) fail when the
committed picture and ``pyproject.toml``'s ``[tool.importlinter]`` disagree. Each ``layers``
contract is a subgraph whose layers point down to the next; the components of one layer
(``|``) sit side by side, imports between them forbidden.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- import-contracts:begin -->"
END = "<!-- import-contracts:end -->"


def contracts(pyproject: Path = ROOT / "pyproject.toml") -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = tomllib.loads(pyproject.read_text())["tool"]["importlinter"][
        "contracts"
    ]
    return found


def _node(name: str) -> str:
    return "m_" + re.sub(r"\W", "_", name)


def diagram(found: list[dict[str, Any]]) -> str:
    """The mermaid text of the layers contracts (one subgraph per container)."""
    lines = ["```mermaid", "flowchart TD"]
    for contract in found:
        if contract["type"] != "layers":
            continue
        for container in contract["containers"]:
            lines.append(f'    subgraph g{_node(container)}["{container}"]')
            lines.append("        direction TB")
            previous: list[str] = []
            for index, layer in enumerate(contract["layers"]):
                parts = [part.strip() for part in layer.split("|")]
                names = [f"{container}.{part}" for part in parts]
                if len(parts) > 1:
                    lines.append(f'        subgraph g{_node(container)}_{index}[" "]')
                    lines.append("            direction LR")
                for part, name in zip(parts, names, strict=True):
                    lines.append(f'        {_node(name)}["{part}"]')
                if len(parts) > 1:
                    lines.append("        end")
                for upper in previous:
                    for lower in names:
                        lines.append(f"        {_node(upper)} --> {_node(lower)}")
                previous = names
            lines.append("    end")
    forbidden = [c for c in found if c["type"] == "independence"]
    for contract in forbidden:
        modules = contract["modules"]
        lines.append(f"    %% independent: {', '.join(modules)}")
    lines.append("```")
    return "\n".join(lines)


def block(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def write(doc: Path = DOC) -> None:
    text = doc.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    doc.write_text(text[:start] + "\n" + diagram(contracts()) + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="write the diagram into the doc")
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc's is stale")
    args = parser.parse_args(argv)
    if args.write:
        write()
        return 0
    if block(DOC.read_text()) != diagram(contracts()):
        print(f"{DOC}: the diagram disagrees with the import contracts; run {__name__} --write")
        return 1
    if not args.check:
        print(diagram(contracts()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
