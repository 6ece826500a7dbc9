"""The ZMQ messages page: every request, reply and event of :mod:`kvpool.common.protocol`
(msgspec structs), its fields in wire order and their types, and the error codes."""

from __future__ import annotations

import enum
import inspect
import re
import typing

import msgspec

from kvpool.common import protocol


def _type(annotation: object) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    text = str(annotation).replace("typing.", "").replace("kvpool.common.protocol.", "")
    return re.sub(r"<class '([^']+)'>", r"\1", text)


def _doc(kind: type) -> str:
    doc = inspect.getdoc(kind) or ""
    if doc == inspect.getdoc(msgspec.Struct) or kind.__doc__ is None:
        return ""
    return " ".join(doc.split())


def _struct(kind: type[msgspec.Struct], heading: str) -> list[str]:
    config = kind.__struct_config__
    fields = msgspec.structs.fields(kind)
    wire = ([f"`{config.tag_field}`"] if config.tag else []) + [f"`{f.name}`" for f in fields]
    lines = [f"### {heading}", ""]
    if _doc(kind):
        lines += [_doc(kind), ""]
    shape = "an array" if config.array_like else "a map"
    lines += [f"On the wire: {shape}, `[{', '.join(wire).replace('`', '')}]`.", ""]
    lines += ["| # | field | type | default | meaning |", "| ---: | --- | --- | --- | --- |"]
    offset = 1 if config.tag else 0
    if config.tag:
        lines.append(f'| 0 | `{config.tag_field}` | `"{config.tag}"` | | the message\'s kind |')
    meanings: dict[str, str] = {}
    for base in reversed(kind.__mro__):
        if base.__module__ == protocol.__name__:
            meanings |= _attribute_docs(base)
    for number, field in enumerate(fields, start=offset):
        default = "" if field.required else f"`{field.default!r}`"
        if field.default_factory is not msgspec.NODEFAULT:
            default = f"`{field.default_factory()!r}`"
        kind_text = _type(field.type).replace("|", "\\|")
        meaning = meanings.get(field.name, "")
        lines.append(f"| {number} | `{field.name}` | `{kind_text}` | {default} | {meaning} |")
    return [*lines, ""]


def _tagged(names: typing.Iterable[str]) -> list[type[msgspec.Struct]]:
    found = []
    for name in names:
        value = getattr(protocol, name)
        if isinstance(value, type) and issubclass(value, msgspec.Struct):
            found.append(value)
    return found


def render() -> str:
    requests: list[type[msgspec.Struct]] = list(protocol.REQUEST_TYPES)
    structs = _tagged(vars(protocol))
    tagged = [
        kind for kind in structs if kind.__struct_config__.tag and not kind.__name__.startswith("_")
    ]
    replies = [kind for kind in tagged if kind not in requests]
    others = [
        kind
        for kind in structs
        if not kind.__struct_config__.tag and not kind.__name__.startswith("_")
    ]
    parts = [
        f"Protocol version {protocol.PROTOCOL_VERSION}; every message is one msgpack frame, a "
        "tagged array `[op, req, ...]`, followed by raw data frames for the inline operations "
        f"only. The events feed publishes on the topic `{protocol.EVENTS_TOPIC.decode()}`.",
        "",
        "## Requests",
        "",
    ]
    for request in requests:
        parts += _struct(request, f"`{request.__struct_config__.tag}` ({request.__name__})")
    parts += ["## Replies", ""]
    for reply in replies:
        parts += _struct(reply, f"`{reply.__struct_config__.tag}` ({reply.__name__})")
    if others:
        parts += ["## Other structures", ""]
        for other in others:
            parts += _struct(other, other.__name__)
    parts += ["## Error codes", "", "| code | meaning |", "| --- | --- |"]
    docs = _member_docs(protocol.ErrorCode)
    for code in protocol.ErrorCode:
        parts.append(f"| `{code.value}` | {docs.get(code.name, '')} |")
    return "\n".join(parts)


def _attribute_docs(kind: type) -> dict[str, str]:
    """The docstrings under a class's own fields (a string literal after ``name: type``)."""
    try:
        source = inspect.getsource(kind)
    except (OSError, TypeError):
        return {}
    found = re.findall(r'^    (\w+): [^\n]+\n    """(.*?)"""', source, re.DOTALL | re.MULTILINE)
    return {name: " ".join(text.split()).replace("|", "\\|") for name, text in found}


def _member_docs(kind: type[enum.Enum]) -> dict[str, str]:
    """The attribute docstrings under an enum's members (a string literal after ``NAME = "x"``)."""
    source = inspect.getsource(kind)
    found = re.findall(r'^\s+([A-Z_]+) = [^\n]+\n\s+"""(.*?)"""', source, re.DOTALL | re.MULTILINE)
    return {name: " ".join(text.split()).replace("|", "\\|") for name, text in found}
