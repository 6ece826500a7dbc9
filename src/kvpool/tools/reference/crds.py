"""The CRD pages: every field of ``KVCachePool`` and ``KVCacheTenant``, from the schema
:mod:`kvpool.operator.crds` generates out of the spec models (the same schema the API
server validates with), with its type, default, bounds and description."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kvpool.operator.crds import RESOURCES, definition


def _type(schema: Mapping[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "int or string"
    kind = str(schema.get("type", "any"))
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        return f"map of {_type(schema['additionalProperties'])}"
    return kind


def _bounds(schema: Mapping[str, Any]) -> str:
    parts: list[str] = []
    if "enum" in schema:
        parts.append("one of " + ", ".join(f"`{value}`" for value in schema["enum"]))
    for key, sign in (("minimum", ">="), ("maximum", "<=")):
        if key in schema:
            exclusive = schema.get("exclusive" + key.capitalize())
            parts.append(f"{sign.replace('=', '') if exclusive else sign} {schema[key]}")
    for key, what in (
        ("minLength", "length >="),
        ("maxLength", "length <="),
        ("minItems", "items >="),
        ("maxItems", "items <="),
    ):
        if key in schema:
            parts.append(f"{what} {schema[key]}")
    if "pattern" in schema:
        parts.append(f"pattern `{schema['pattern']}`")
    for rule in schema.get("x-kubernetes-validations", []):
        parts.append(str(rule.get("message") or rule.get("rule")))
    return "; ".join(parts)


def _default(schema: Mapping[str, Any]) -> str:
    if "default" not in schema:
        return ""
    value = schema["default"]
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == {}:
        return "`{}` (its fields' defaults)"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def rows(schema: Mapping[str, Any], path: str) -> Iterator[str]:
    """A table row per field under ``schema`` (an object's), nested fields after their parent."""
    required = set(schema.get("required", ()))
    for name, field in schema.get("properties", {}).items():
        where = f"{path}.{name}" if path else name
        needed = " (required)" if name in required else ""
        cells = (
            f"`{where}`{needed}",
            _type(field),
            _default(field),
            _bounds(field),
            str(field.get("description", "")),
        )
        yield "| " + " | ".join(_cell(cell) for cell in cells) + " |"
        if field.get("type") == "object":
            yield from rows(field, where)
        elif field.get("type") == "array" and field.get("items", {}).get("type") == "object":
            yield from rows(field["items"], f"{where}[]")


HEADER = "| field | type | default | bounds and rules | meaning |\n| --- | --- | --- | --- | --- |"


def render() -> str:
    parts: list[str] = []
    for resource in RESOURCES:
        crd = definition(resource)
        names = crd["spec"]["names"]
        version = crd["spec"]["versions"][0]
        schema = version["schema"]["openAPIV3Schema"]
        short = ", ".join(names.get("shortNames", []))
        parts += [
            f"## {names['kind']}",
            "",
            f"`{crd['spec']['group']}/{version['name']}`, {crd['spec']['scope']}; "
            f"`kubectl get {names['plural']}`" + (f" (short: `{short}`)" if short else "") + ".",
            "",
            _cell(str(schema.get("description", ""))),
            "",
        ]
        for part in ("spec", "status"):
            if part in schema.get("properties", {}):
                parts += [f"### `{part}`", "", HEADER, *rows(schema["properties"][part], part), ""]
    return "\n".join(parts).rstrip()
