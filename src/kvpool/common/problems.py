"""Mistakes in one line each: a refused configuration, named where the user wrote it.

Every console script of kvpool reads settings from some of: its command line, environment
variables, a YAML or JSON file, vLLM's ``kv_connector_extra_config``. When pydantic refuses
them, :func:`describe` turns each problem of the :class:`~pydantic.ValidationError` into one
line that names the setting as the user wrote it (``KVPOOL_L1_SIZE``, ``agent.yaml:
nvme.capacity``, ``--endpoint``), the value, and what is wrong. The scripts print those lines
and exit 2 (:func:`exit_with`); :class:`ArgumentParser` does the same for their command
lines, and :func:`listening` for a port that cannot be bound.

Standard library and pydantic only: the connector (inside vLLM) and the operator import it.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import json
import logging
import os
import re
import sys
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # pydantic is imported by what validates, not by every script's start
    from pydantic import BaseModel, ValidationError

Loc = tuple[str | int, ...]
"""Where a value sits in a model: field names and list indexes, outermost first."""

EXIT_USAGE = 2
"""The exit status of a usage or configuration error (as argparse's)."""

_SHOWN_WORD = 300
_SHOWN_JSON = 80
_MISSING = object()


class ConfigError(ValueError):
    """A configuration refused: one line per problem, each naming where and what."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class SettingError(ValueError):
    """A model validator's refusal, naming the fields it is about with their values.

    ``SettingError("low_watermark must be below high_watermark", low_watermark=0.95,
    high_watermark=0.9)``: :func:`describe` names each field where the user set it. A
    location deeper in the model is a tuple in ``at``: ``at={("agents", 1, "node"): "a"}``.
    """

    def __init__(
        self, message: str, at: Mapping[Loc, object] | None = None, **values: object
    ) -> None:
        super().__init__(message)
        self.values: dict[Loc, object] = {(field,): value for field, value in values.items()}
        self.values.update(at or {})


def show(value: object) -> str:
    """``value`` as a problem line shows it: a plain string as is, the rest as JSON, short."""
    if isinstance(value, PurePath):
        value = str(value)
    if isinstance(value, str) and value and not any(c.isspace() or c == '"' for c in value):
        text, most = value, _SHOWN_WORD  # a path, a URL: whole
    else:
        text, most = json.dumps(value, default=str), _SHOWN_JSON
    if len(text) > most:
        text = text[: most - 3] + "..."
    return text


def dotted(loc: Loc) -> str:
    """``nvme.capacity``, ``agents[0].node``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


# ---------------------------------------------------------------- where values come from


@dataclass(frozen=True)
class Found:
    """How far an origin holds a location (``depth`` parts of it), how the user wrote the
    location there, and the value at it (if it holds all of it)."""

    depth: int
    name: str
    value: object = _MISSING


class Origin(ABC):
    """One source of settings: knows which it set and how the user spelled them."""

    joiner = "="
    """Between a name and its value: ``KVPOOL_L1_SIZE=64Mi``, ``--endpoint HOST:PORT``."""

    @abstractmethod
    def find(self, loc: Loc) -> Found | None:
        """How much of ``loc`` this origin holds; None: nothing of it."""


class EnvironmentOrigin(Origin):
    """Environment variables of a pydantic-settings model: ``prefix`` + field names joined
    by ``delimiter``, any case; a variable of a nested model or a list holds JSON."""

    def __init__(self, prefix: str, delimiter: str | None, environ: Mapping[str, str]) -> None:
        self._prefix = prefix
        self._delimiter = delimiter or ""
        self._environ = environ
        self._names = {name.casefold(): name for name in environ}

    def _variable(self, parts: Loc) -> str | None:
        if not parts or not all(isinstance(part, str) for part in parts):
            return None
        if len(parts) > 1 and not self._delimiter:
            return None
        wanted = self._prefix + self._delimiter.join(str(part) for part in parts)
        return self._names.get(wanted.casefold())

    def find(self, loc: Loc) -> Found | None:
        for depth in range(len(loc), 0, -1):
            variable = self._variable(loc[:depth])
            if variable is None:
                continue
            raw = self._environ[variable]
            if depth == len(loc):
                return Found(depth, variable, raw)
            try:
                held, value = _descend(json.loads(raw), loc[depth:])
            except ValueError:
                held, value = 0, _MISSING
            name = variable + _json_path(loc[depth:])
            return Found(depth + held, name, value if held == len(loc) - depth else _MISSING)
        # a missing field of a nested model whose other fields come from variables
        parent = self._prefix + self._delimiter.join(str(part) for part in loc[:-1])
        if (
            len(loc) > 1
            and self._delimiter
            and all(isinstance(part, str) for part in loc)
            and any(name.startswith((parent + self._delimiter).casefold()) for name in self._names)
        ):
            return Found(len(loc) - 1, (parent + self._delimiter + str(loc[-1])).upper())
        return None


class MappingOrigin(Origin):
    """Settings from a mapping the user wrote: a YAML/JSON file, ``kv_connector_extra_config``;
    ``label`` names it (the file's path)."""

    def __init__(self, label: str, values: Mapping[str, Any]) -> None:
        self._label = label
        self._values = values

    def find(self, loc: Loc) -> Found | None:
        held, value = _descend(self._values, loc)
        if held == 0:
            return None
        return Found(held, f"{self._label}: {dotted(loc)}", value)


class FlagOrigin(Origin):
    """Settings from the command line: each location (or the top of it) is one flag, given
    as ``{loc: (flag, what the user typed)}``. With ``joiner="="``: named variables."""

    def __init__(self, flags: Mapping[Loc, tuple[str, object]], joiner: str = " ") -> None:
        self._flags = flags
        self.joiner = joiner

    def find(self, loc: Loc) -> Found | None:
        for depth in range(len(loc), 0, -1):
            if loc[:depth] in self._flags:
                flag, value = self._flags[loc[:depth]]
                return Found(len(loc), flag, value)
        return None


def _descend(values: object, loc: Loc) -> tuple[int, object]:
    """How many parts of ``loc`` lead into ``values``, and the value at the end of them."""
    held, value = 0, values
    for part in loc:
        in_mapping = isinstance(part, str) and isinstance(value, Mapping) and part in value
        in_list = isinstance(part, int) and isinstance(value, list) and 0 <= part < len(value)
        if not (in_mapping or in_list):
            return held, _MISSING
        value = value[part]  # type: ignore[index]
        held += 1
    return held, value


def _json_path(loc: Loc) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)


def _locate(loc: Loc, origins: Sequence[Origin], *, missing: bool) -> tuple[Origin, Found] | None:
    """The origin that set ``loc`` (the first, in precedence order, that holds all of it),
    else the one that holds most of it; for a missing field, the one that holds its parent."""
    best: tuple[Origin, Found] | None = None
    for origin in origins:
        found = origin.find(loc)
        if found is None:
            continue
        if found.depth == len(loc) and not missing:
            return origin, found
        if best is None or found.depth > best[1].depth:
            best = origin, found
    if best is None or (missing and best[1].depth < len(loc) - 1) or best[1].depth == 0:
        return None
    return best


def _label(origin: Origin, found: Found) -> str:
    if found.value is _MISSING:
        return found.name
    return f"{found.name}{origin.joiner}{show(found.value)}"


# ---------------------------------------------------------------- the lines


def describe(
    error: ValidationError,
    origins: Sequence[Origin] = (),
    model: type[BaseModel] | None = None,
) -> list[str]:
    """One line per problem of ``error``: where the user set the value (the first of
    ``origins``, highest precedence first, that holds it), the value, and what is wrong.

    ``model`` is the model validated: an unknown key is answered with the known ones.
    """
    lines = []
    for problem in error.errors():
        loc: Loc = tuple(problem["loc"])
        cause = problem.get("ctx", {}).get("error")
        if isinstance(cause, SettingError):
            lines.append(_setting_line(loc, cause, origins))
            continue
        missing = problem["type"] == "missing"
        where = named(loc, _MISSING if missing else problem["input"], origins)
        message = _message(problem, loc, model)
        lines.append(f"{where}: {message}" if where else message)
    return lines


def named(loc: Loc, value: object, origins: Sequence[Origin]) -> str:
    """The setting at ``loc`` as the user wrote it (``KVPOOL_NVME__PATH=/x``, ``a.yaml:
    nvme.path=/x``), or as the model names it with ``value`` (none: a missing one)."""
    located = _locate(loc, origins, missing=value is _MISSING)
    if located is not None:
        return _label(*located)
    if not loc or value is _MISSING:
        return dotted(loc)
    return f"{dotted(loc)}={show(value)}"


def _setting_line(loc: Loc, cause: SettingError, origins: Sequence[Origin]) -> str:
    named = []
    for field in cause.values:
        located = _locate((*loc, *field), origins, missing=False)
        if located is not None and _label(*located) not in named:
            named.append(_label(*located))
    if not named:  # nothing the user set: name the fields with what they default to
        for field, value in cause.values.items():
            name = dotted((*loc, *field))
            empty = value is None or value in ([], {})
            named.append(f"{name} (not set)" if empty else f"{name}={show(value)} (default)")
    return f"{', '.join(named)}: {cause}"


def _message(problem: Mapping[str, Any], loc: Loc, model: type[BaseModel] | None) -> str:
    kind, text = problem["type"], str(problem["msg"])
    if kind == "missing":
        return "required, not set"
    if kind == "extra_forbidden":
        return _unknown(loc, problem["input"], model)
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return "should be a mapping of settings" + (
            " (a JSON object)" if isinstance(problem["input"], str) else ""
        )
    if kind == "list_type" and isinstance(problem["input"], str):
        return "should be a list (JSON)"
    for prefix in ("Value error, ", "Assertion failed, "):
        text = text.removeprefix(prefix)
    return text[:1].lower() + text[1:]


def _unknown(loc: Loc, value: object, model: type[BaseModel] | None) -> str:
    known = _known_fields(model, loc[:-1])
    if not known or not isinstance(loc[-1], str):
        return "unknown setting"
    key = loc[-1]
    if isinstance(value, Mapping):  # `l1: {size: 64Mi}` for l1_size
        joined = [f"{key}_{inner}" for inner in value if f"{key}_{inner}" in known]
        if joined:
            return f"unknown setting; did you mean {' and '.join(joined)}?"
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"unknown setting; did you mean {close[0]}?"
    return f"unknown setting; known: {', '.join(sorted(known))}"


def _known_fields(model: type[BaseModel] | None, loc: Loc) -> list[str]:
    for part in loc:
        if model is None:
            return []
        if isinstance(part, str):
            field = model.model_fields.get(part)
            model = None if field is None else nested_model(field.annotation)
    return [] if model is None else list(model.model_fields)


def nested_model(annotation: object) -> type[BaseModel] | None:
    """The model inside a field's type (``NvmeTierConfig | None``, ``list[StaticAgent]``)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, typing.Annotated):
        for argument in typing.get_args(annotation):
            found = nested_model(argument)
            if found is not None:
                return found
    return None


# ---------------------------------------------------------------- the scripts


def exit_with(prog: str, error: ConfigError) -> int:
    """Print ``error``'s lines on stderr, each after ``prog``; the exit status to return."""
    for line in error.problems:
        print(f"{prog}: {line}", file=sys.stderr)
    return EXIT_USAGE


_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]*\.)?([^`]+)`")
"""A Sphinx role in a docstring: ``:class:`~kvpool.x.Name``` (shown: ``Name``)."""


def plain(text: str) -> str:
    """``text`` (a docstring used as help) without its reStructuredText markup: inline
    literals and roles become their words, a ``::`` that opens a literal block a ``:``."""
    text = _ROLE.sub(r"\1", text)
    return text.replace("``", "").replace("::\n", ":\n")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a mistake on the command line in one line (not the usage, then the
    error): ``kvpool-operator: argument --retry-seconds: invalid float value: 'x'``; and a
    help text without the markup of the docstrings it shows (:func:`plain`)."""

    def format_help(self) -> str:
        return plain(super().format_help())

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def add_log_level(self) -> None:
        """``--log-level``: a :mod:`logging` level's name, in any case, for
        :func:`start_logging`."""
        self.add_argument(
            "--log-level", type=_log_level, default="INFO", help="logging level (default INFO)"
        )


def _log_level(text: str) -> str:
    level = text.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"Unknown level: {level!r}")
    return level


def start_logging(level: str) -> None:
    """A console script's logging, at ``level`` (from ``--log-level``), one line a record."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def number(
    kind: type[int] | type[float], *, zero: bool = False, most: float | None = None
) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` above 0 (or 0 too, with ``zero``), and at
    most ``most`` if given."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}") from None
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(
                f"expected a number {'of 0 or more' if zero else 'above 0'}, not {text}"
            )
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"expected a number of at most {most}, not {text}")
        return value

    return parse


def numbers(kind: type[int] | type[float], *, zero: bool = False) -> Callable[[str], list[float]]:
    """An argparse type: comma-separated numbers, each as :func:`number` reads it."""
    one = number(kind, zero=zero)

    def parse(text: str) -> list[float]:
        return [one(item.strip()) for item in text.split(",")]

    return parse


@contextlib.contextmanager
def listening(setting: str, host: str, port: int) -> Iterator[None]:
    """Around the bind of a listening socket: a port in use, or an address the host does
    not have, is a :class:`ConfigError` naming ``setting`` (``zmq_port``)."""
    try:
        yield
    except Exception as error:  # OSError, zmq.ZMQError: each carries an errno
        code = getattr(error, "errno", None)
        if code is None:
            raise
        if code == errno.EADDRINUSE:
            raise ConfigError([f"port {port} ({setting}) is in use on {host}"]) from error
        reason = os.strerror(code) if code > 0 else getattr(error, "strerror", None) or error
        raise ConfigError(
            [f"cannot listen on {host}:{port} (host, {setting}): {reason}"]
        ) from error


def yaml_problem(error: Exception) -> str:
    """Where a YAML file is broken and how (a ``yaml.YAMLError``), in one line, quoting
    none of its text. Read by its attributes, so that this module needs no YAML library."""
    mark = getattr(error, "problem_mark", None)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {getattr(error, 'problem', '')}"
    return " ".join(str(error).split())
