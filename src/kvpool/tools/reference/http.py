"""The HTTP API pages: the agent's and the prefix index's routes and bodies, from the
OpenAPI schema their FastAPI apps serve at ``/openapi.json``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from fastapi import FastAPI

from kvpool.agent.edge import http_api as agent_api
from kvpool.index import http_api as index_api

Schema = Mapping[str, Any]
_NOTHING = cast(Any, None)
"""The apps' services: building the routes touches none of them."""


def agent_app() -> FastAPI:
    return agent_api.create_app(
        _NOTHING, _NOTHING, metrics=cast(Any, object()), peers=cast(Any, lambda probe: None)
    )


def index_app() -> FastAPI:
    return index_api.create_app(_NOTHING, _NOTHING, list, metrics=cast(Any, object()))


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _ref(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def _type(schema: Schema) -> str:
    if "$ref" in schema:
        name = _ref(schema["$ref"])
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_type(branch) for branch in schema[key])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), Mapping):
        return f"map of {_type(schema['additionalProperties'])}"
    if "const" in schema:
        return f"`{schema['const']!r}`"
    if "enum" in schema:
        return " \\| ".join(f"`{value}`" for value in schema["enum"])
    return str(kind)


def _route(path: str, method: str, operation: Schema) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", ""]
    if operation.get("summary"):
        lines += [f"**{_cell(operation['summary'])}**", ""]
    if operation.get("description"):
        lines += [operation["description"].strip(), ""]
    parameters = operation.get("parameters", [])
    if parameters:
        lines += ["| parameter | in | type | meaning |", "| --- | --- | --- | --- |"]
        for parameter in parameters:
            required = " (required)" if parameter.get("required") else ""
            name, kind = f"`{parameter['name']}`{required}", _type(parameter.get("schema", {}))
            meaning = _cell(parameter.get("description", ""))
            lines.append(f"| {name} | {parameter['in']} | {kind} | {meaning} |")
        lines.append("")
    body = operation.get("requestBody", {}).get("content", {}).get("application/json")
    if body:
        lines += [f"Body: {_type(body['schema'])}.", ""]
    lines += ["| answer | meaning | body |", "| --- | --- | --- |"]
    for code, response in operation.get("responses", {}).items():
        content = response.get("content", {})
        shown = ""
        if "application/json" in content:
            shown = _type(content["application/json"].get("schema", {}))
        elif content:
            shown = ", ".join(f"`{kind}`" for kind in content)
        lines.append(f"| {code} | {_cell(response.get('description', ''))} | {shown} |")
    return [*lines, ""]


def _schema(name: str, schema: Schema) -> list[str]:
    lines = [f"### {name}", ""]
    if schema.get("description"):
        lines += [_cell(schema["description"]), ""]
    properties = schema.get("properties", {})
    if not properties:
        return [*lines, f"Type: {_type(schema)}.", ""]
    required = set(schema.get("required", ()))
    lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for field, spec in properties.items():
        default = f"`{spec['default']!r}`" if "default" in spec else ""
        needed = " (required)" if field in required else ""
        meaning = _cell(spec.get("description", ""))
        lines.append(f"| `{field}`{needed} | {_type(spec)} | {default} | {meaning} |")
    return [*lines, ""]


def render(app: FastAPI) -> str:
    spec = app.openapi()
    info = spec["info"]
    parts = [
        f"`{info['title']}`, API version {info['version']}: the same schema the running process "
        "serves at `/openapi.json`.",
        "",
        info.get("description", "").strip(),
        "",
        "## Routes",
        "",
    ]
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            parts += _route(path, method, operation)
    parts += ["## Bodies", ""]
    for name, schema in sorted(spec.get("components", {}).get("schemas", {}).items()):
        parts += _schema(name, schema)
    return "\n".join(parts).rstrip()


def render_agent() -> str:
    return render(agent_app())


def render_index() -> str:
    return render(index_app())
