"""Read a Dockerfile and a .dockerignore as Docker does, without a Docker engine.

- :func:`parse`: instructions (line continuations, comments, parser directives) grouped in
  build stages;
- :class:`DockerIgnore`: BuildKit's ``.dockerignore`` semantics (moby/patternmatcher):
  patterns are cleaned and made relative, ``*`` and ``?`` stay within one path element,
  ``**`` spans any number of them, a pattern excludes a file when it matches the file or
  one of its parent directories, ``!`` re-includes, and the last matching pattern wins.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str
    """Upper case: FROM, RUN, COPY, ..."""
    arguments: str
    line: int

    def flags(self) -> dict[str, str]:
        """Its ``--name=value`` flags (COPY --from=build ...)."""
        return dict(re.findall(r"(?:^|\s)--([\w-]+)=(\S+)", self.arguments))

    def words(self) -> list[str]:
        """The arguments without their leading flags, from JSON (exec) or shell form."""
        text = self.arguments.strip()
        if text.startswith("["):
            words: list[str] = json.loads(text)
            return words
        return [word for word in text.split() if not word.startswith("--")]

    def is_exec_form(self) -> bool:
        return self.arguments.strip().startswith("[")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def of(self, keyword: str) -> list[Instruction]:
        return [instruction for instruction in self.instructions if instruction.keyword == keyword]


def parse(text: str) -> list[Stage]:
    stages: list[Stage] = []
    logical = ""
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue  # comments (and parser directives) between instructions
        if logical and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped
        if not logical:
            start = number
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        keyword, _, arguments = logical.partition(" ")
        instruction = Instruction(keyword.upper(), " ".join(arguments.split()), start)
        logical = ""
        if instruction.keyword == "FROM":
            match = re.fullmatch(
                r"(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", instruction.arguments, re.I
            )
            if match is None:
                raise ValueError(f"line {start}: cannot read FROM {instruction.arguments}")
            stages.append(Stage(match[1], match[2]))
        elif not stages:
            if instruction.keyword != "ARG":
                raise ValueError(f"line {start}: {instruction.keyword} before the first FROM")
        else:
            stages[-1].instructions.append(instruction)
    return stages


def copy_sources(instruction: Instruction) -> list[str]:
    """The sources of a COPY or ADD (every word but the last, flags left out)."""
    return instruction.words()[:-1]


class DockerIgnore:
    def __init__(self, text: str) -> None:
        self.patterns: list[tuple[bool, re.Pattern[str]]] = []
        self._inclusions: list[str] = []
        for line in text.splitlines():
            pattern = line.strip()
            if not pattern or pattern.startswith("#"):
                continue
            exclusion = pattern.startswith("!")
            pattern = posixpath.normpath(pattern.removeprefix("!").strip())
            if len(pattern) > 1 and pattern.startswith("/"):
                pattern = pattern[1:]
            self.patterns.append((exclusion, re.compile(_regex(pattern))))
            if exclusion:
                self._inclusions.append(pattern)

    @classmethod
    def read(cls, path: Path) -> DockerIgnore:
        return cls(path.read_text())

    def excluded(self, path: str) -> bool:
        """Whether ``path`` (relative to the context, with /) stays out of the context."""
        parents = posixpath.dirname(path).split("/") if "/" in path else []
        matched = False
        for exclusion, regex in self.patterns:
            if exclusion != matched:
                continue  # only a re-inclusion can change an excluded file, and vice versa
            match = regex.match(path) is not None or any(
                regex.match("/".join(parents[: index + 1])) for index in range(len(parents))
            )
            if match:
                matched = not exclusion
        return matched

    def context(self, root: Path) -> list[str]:
        """The files of ``root`` that the build context holds."""
        files = []
        for directory, subdirectories, names in os.walk(root):
            # skip excluded trees that no '!' pattern reaches into (.git, .venv, ...)
            subdirectories[:] = [
                name
                for name in subdirectories
                if not self.excluded(relative := Path(directory, name).relative_to(root).as_posix())
                or self._may_include_below(relative)
            ]
            for name in names:
                relative = Path(directory, name).relative_to(root).as_posix()
                if not self.excluded(relative):
                    files.append(relative)
        return sorted(files)

    def _may_include_below(self, directory: str) -> bool:
        top = directory.split("/", maxsplit=1)[0]
        return any(
            re.search(r"[*?\[\\]", first) or first == top
            for first in (pattern.split("/")[0] for pattern in self._inclusions)
        )


def _regex(pattern: str) -> str:
    """patternmatcher's translation of one pattern into a regular expression."""
    out = "^"
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "*":
            if pattern[index + 1 : index + 2] == "*":
                index += 1
                if pattern[index + 1 : index + 2] == "/":
                    index += 1
                out += ".*" if index + 1 >= len(pattern) else "(.*/)?"
            else:
                out += "[^/]*"
        elif char == "?":
            out += "[^/]"
        elif char in ".$+()|{}^":
            out += "\\" + char
        elif char == "\\" and index + 1 < len(pattern):
            index += 1
            out += re.escape(pattern[index])
        else:
            out += char  # letters, '/', and '[...]' classes pass through
        index += 1
    return out + "$"
