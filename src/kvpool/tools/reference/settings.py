"""The settings page: every setting of the agent, the prefix index and the vLLM connector,
generated from their configuration models.

Each row is a setting as a configuration file spells it (nested ones as ``nvme.path``), its
environment variable, its default and its description
(:class:`~kvpool.common.config.AgentConfig`, :class:`~kvpool.common.index_config.IndexConfig`,
:class:`~kvpool.connector.settings.ConnectorSettings`).
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from kvpool.common.config import AgentConfig
from kvpool.common.index_config import IndexConfig
from kvpool.common.problems import nested_model
from kvpool.common.sizes import format_size, is_size
from kvpool.connector.settings import EXTRA_CONFIG, OVERRIDES, ConnectorSettings

NONE = "—"
"""An environment column's cell where no variable sets the field on its own."""


@dataclass(frozen=True)
class Row:
    setting: str
    variable: str
    default: str
    meaning: str

    def line(self) -> str:
        meaning = _PLACEHOLDER.sub(lambda match: f"`{match[0]}`", self.meaning)
        cells = (f"`{self.setting}`", self.variable, self.default, meaning)
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


_PLACEHOLDER = re.compile(r"[^\s`(]*<[a-z_]+>[^\s`),;]*(?<![.])")
"""A word with a ``<placeholder>`` (``<state_dir>/l2-keys``): code, or markdown drops it."""


Variable = Callable[[tuple[str, ...]], str | None]
"""The environment variable of a field's location (names of fields, outermost first)."""


def settings_variable(model: type[BaseSettings]) -> Variable:
    """``KVPOOL_NVME__PATH``: pydantic-settings' variable of a location in ``model``."""
    config = model.model_config
    prefix, delimiter = config.get("env_prefix") or "", config.get("env_nested_delimiter") or ""

    def variable(loc: tuple[str, ...]) -> str:
        return (prefix + delimiter.join(loc)).upper()

    return variable


_REQUIRED = object()


def rows(
    model: type[BaseModel],
    variable: Variable,
    *,
    loc: tuple[str, ...] = (),
    shown: str = "",
    defaults: BaseModel | None = None,
    in_json: bool = False,
) -> Iterator[Row]:
    """A row per field of ``model``; a nested model's fields follow it (``nvme.path``)."""
    for name, field in model.model_fields.items():
        where = (*loc, name)
        setting = f"{shown}.{name}" if shown else name
        default = _default(name, field, defaults)
        env = NONE if in_json else variable(where) or NONE
        nested = nested_model(field.annotation)
        listed = _is_list(field.annotation)
        if nested is None or listed or default is None:
            # a plain field, a list of models (one JSON variable), an optional model
            json = " (JSON)" if nested is not None and env != NONE else ""
            shown_env = f"`{env}`{json}" if env != NONE else env
            yield Row(setting, shown_env, _shown(default, field), field.description or "")
        if nested is not None:
            yield from rows(
                nested,
                variable,
                loc=where,
                shown=f"{setting}[]" if listed else setting,
                defaults=default if isinstance(default, BaseModel) else None,
                in_json=in_json or listed,
            )


def _default(name: str, field: FieldInfo, defaults: BaseModel | None) -> object:
    """The field's default: in its parent's default where that is a model (the index's
    ``http_limits`` differ from the agent's), else its own."""
    if defaults is not None:
        return getattr(defaults, name)
    if field.is_required():
        return _REQUIRED
    return field.get_default(call_default_factory=True, validated_data={})


def _is_list(annotation: object) -> bool:
    if typing.get_origin(annotation) is list:
        return True
    return any(_is_list(argument) for argument in typing.get_args(annotation))


def _shown(value: object, field: FieldInfo) -> str:
    if value is _REQUIRED:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, int) and is_size(field):
        text = format_size(value)
    elif isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, PurePath):
        home = str(Path.home())
        text = str(value)
        text = "~" + text[len(home) :] if text.startswith(home + "/") else text
    elif isinstance(value, list):
        text = "[]" if not value else str(value)
    else:
        text = str(value)
    return f"`{text}`"


HEADER = "| setting | environment variable | default | meaning |\n| --- | --- | --- | --- |"


def _table(lines: Iterator[Row]) -> str:
    return "\n".join([HEADER, *(row.line() for row in lines)])


def render() -> str:
    """The page's tables, one section per process."""

    def connector_variable(loc: tuple[str, ...]) -> str | None:
        return OVERRIDES.get(loc[0]) if len(loc) == 1 else None

    parts = [
        "## The agent (`kvpool-agent`)",
        "",
        "`kvpool.common.config.AgentConfig`; the file: `--config` or `KVPOOL_CONFIG_FILE`.",
        "",
        _table(rows(AgentConfig, settings_variable(AgentConfig))),
        "",
        "## The prefix index (`kvpool-index`)",
        "",
        "`kvpool.common.index_config.IndexConfig`; the file: `--config` or "
        "`KVPOOL_INDEX_CONFIG_FILE`; `--agent` adds to `agents` (and sets `discovery: static`).",
        "",
        _table(rows(IndexConfig, settings_variable(IndexConfig))),
        "",
        f"## The vLLM connector (`{EXTRA_CONFIG}`)",
        "",
        "`kvpool.connector.settings.ConnectorSettings`; a variable overrides its key. Its old "
        "name, without `CONNECTOR_` (`KVPOOL_ENDPOINT` ...), is still read, with a warning "
        "([The connector's variables](../vllm/connector.md#the-connectors-variables)).",
        "",
        _table(rows(ConnectorSettings, connector_variable)),
    ]
    return "\n".join(parts)
