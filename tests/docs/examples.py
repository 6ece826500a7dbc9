"""The code blocks of the documentation, with what each one is marked as.

A block's marker is an HTML comment on the line before its fence:
``<!-- example: skip (the reason) -->``, ``<!-- example: agent -->`` (Python run against a
real agent), ``<!-- example: agent-config -->``, ``<!-- example: tokens-file -->``,
``<!-- example: pool-fragment -->`` (YAML, validated as that).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOCUMENTS = (ROOT / "README.md", *sorted(DOCS.rglob("*.md")))
"""Every page of the site, and the README."""
_BLOCK = re.compile(
    r"(?:^<!-- example: (?P<marker>[^>]*?) -->\n)?^(?P<indent> *)```(?P<language>[\w-]*)[^\n]*\n"
    r"(?P<code>.*?)^(?P=indent)```$",
    re.MULTILINE | re.DOTALL,
)
_SKIP = re.compile(r"skip \((.+)\)")


@dataclass(frozen=True)
class Example:
    path: Path
    line: int
    language: str
    marker: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def skipped(self) -> str | None:
        """Why the block cannot run, if it is marked so (a reason is required)."""
        found = _SKIP.fullmatch(self.marker)
        return found[1] if found else None


def examples(path: Path) -> list[Example]:
    text = path.read_text()
    found = []
    for match in _BLOCK.finditer(text):
        indent = len(match["indent"])
        code = "\n".join(line[indent:] for line in match["code"].splitlines()) + "\n"
        line = text.count("\n", 0, match.start("indent")) + 1
        found.append(Example(path, line, match["language"], match["marker"] or "", code))
    return found


def all_examples(language: str) -> list[Example]:
    return [
        example for path in DOCUMENTS for example in examples(path) if example.language == language
    ]
