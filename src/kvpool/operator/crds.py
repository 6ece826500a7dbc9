"""kvpool's CustomResourceDefinitions, generated from the models of :mod:`kvpool.operator.spec`.

    python -m kvpool.operator.crds          # writes crds/*.yaml and charts/kvpool/crds/*.yaml
    python -m kvpool.operator.crds --check  # exits 1, naming each file that differs

It also writes the schema of the chart's ``examplePool.spec`` (in
``charts/kvpool/values.schema.json``): the KVCachePool spec's, as JSON Schema
(:func:`values_schema`), so that ``helm lint`` and ``helm template`` refuse what the API
server would (``l1.sise``, ``size: 1GB``), CEL rules aside.

A resource model's JSON schema (pydantic's, with the models' CEL rules and list markers
in it) becomes the structural schema an API server takes:

- a ``$ref`` is inlined, the field's description, default and markers over the model's
  (its CEL rules added to the model's);
- an optional field (``X | None``) is ``X``: the API server leaves it absent, never null;
- ``int | str`` is ``x-kubernetes-int-or-string``; an object of any fields
  (``dict[str, Any]``) keeps its unknown fields (``x-kubernetes-preserve-unknown-fields``);
- ``exclusiveMinimum``/``exclusiveMaximum`` take OpenAPI 3.0's form (a boolean beside
  ``minimum``/``maximum``);
- a default that is a model instance is ``{}``: the API server fills in its fields'
  defaults in turn (and the instance must be the model's own defaults); a whole float is
  written as an integer;
- titles go, descriptions are one line each.

Any other JSON schema construct (``const``, ``oneOf``, ...) is an error, not a guess.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue

from kvpool.common.names import APP, NAME_LABEL
from kvpool.operator.spec import GROUP, VERSION, KVCachePool, KVCacheTenant
from kvpool.operator.spec.base import Resource

RESOURCES: tuple[type[Resource], ...] = (KVCachePool, KVCacheTenant)
TARGETS = (Path("crds"), Path("charts/kvpool/crds"))
"""Where the CRDs go, from the repository's root: kubectl's and the chart's."""

Schema = dict[str, Any]

_KEYS = (
    "type",
    "format",
    "x-kubernetes-int-or-string",
    "default",
    "enum",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "maxProperties",
    "description",
    "required",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
    "additionalProperties",
    "properties",
    "items",
)
"""The keywords a generated schema may use, in the order they are written."""


class _CrdJsonSchema(GenerateJsonSchema):
    def sort(self, value: JsonSchemaValue, parent_key: str | None = None) -> JsonSchemaValue:
        return value  # as declared: a rule before its message, fields in their order

    def encode_default(self, dft: Any) -> Any:
        if isinstance(dft, BaseModel):
            if dft != type(dft)():
                raise ValueError(f"a CRD default of an object is {{}}, not {dft!r}")
            return {}
        if isinstance(dft, float) and dft.is_integer():
            return int(dft)  # 30, not 30.0: the same number to the API server, as people write it
        return super().encode_default(dft)


def openapi_schema(model: type[BaseModel]) -> Schema:
    """The structural schema of ``model`` (its ``openAPIV3Schema``, for a resource)."""
    schema = model.model_json_schema(by_alias=True, schema_generator=_CrdJsonSchema)
    return _structural(schema, schema.get("$defs", {}))


def _structural(node: Mapping[str, Any], defs: Mapping[str, Schema]) -> Schema:
    schema = {key: value for key, value in node.items() if key not in ("$defs", "title")}
    if "$ref" in schema:
        model = defs[schema.pop("$ref").removeprefix("#/$defs/")]
        schema = _merge(_structural(model, defs), schema)
    if "anyOf" in schema:
        branches = [branch for branch in schema.pop("anyOf") if branch != {"type": "null"}]
        schema = _merge(_union(branches, defs), schema)
    if schema.get("default", ...) is None:
        del schema["default"]
    extra = schema.pop("additionalProperties", False)
    if extra is True:
        schema["x-kubernetes-preserve-unknown-fields"] = True
    elif extra is not False:
        schema["additionalProperties"] = _structural(extra, defs)
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if exclusive in schema and not isinstance(schema[exclusive], bool):
            schema[bound], schema[exclusive] = schema[exclusive], True
    if "description" in schema:
        schema["description"] = " ".join(schema["description"].split())
    if "properties" in schema:
        schema["properties"] = {
            name: _structural(child, defs) for name, child in schema["properties"].items()
        }
    if "items" in schema:
        schema["items"] = _structural(schema["items"], defs)
    unknown = set(schema) - set(_KEYS)
    if unknown:
        raise ValueError(f"no structural schema for {sorted(unknown)} in {node}")
    return {key: schema[key] for key in _KEYS if key in schema}


def _merge(model: Schema, field: Schema) -> Schema:
    """A model's schema under a field's keywords; the CEL rules of both."""
    rules = [*model.get("x-kubernetes-validations", ()), *field.get("x-kubernetes-validations", ())]
    merged = {**model, **field}
    if rules:
        merged["x-kubernetes-validations"] = rules
    return merged


def _union(branches: list[Schema], defs: Mapping[str, Schema]) -> Schema:
    if len(branches) == 1:
        return _structural(branches[0], defs)
    if sorted(branch.get("type", "") for branch in branches) == ["integer", "string"]:
        (text,) = (branch for branch in branches if branch["type"] == "string")
        return {
            "x-kubernetes-int-or-string": True,
            **{k: v for k, v in text.items() if k != "type"},
        }
    raise ValueError(f"no structural schema for a union of {branches}")


VALUES_SCHEMA = Path("charts/kvpool/values.schema.json")
"""The chart's values schema, written by hand but for ``examplePool.spec``."""
_OPENAPI_ONLY = ("x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys")
"""What JSON Schema has no keyword for: CEL rules (the API server's), list markers."""


def json_schema(structural: Schema) -> Schema:
    """A structural (OpenAPI 3.0) schema as JSON Schema (draft 7), as helm checks values:
    an object takes no field it does not name (the API server would drop it, silently),
    ``int-or-string`` is either type, an exclusive bound is a number; CEL rules and list
    markers go."""
    schema = {key: value for key, value in structural.items() if key not in _OPENAPI_ONLY}
    if schema.pop("x-kubernetes-int-or-string", False):
        schema = {"type": ["integer", "string"], **schema}
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if schema.pop(exclusive, False):
            schema[exclusive] = schema.pop(bound)
    if "properties" in schema:
        schema["properties"] = {
            name: json_schema(child) for name, child in schema["properties"].items()
        }
    if "items" in schema:
        schema["items"] = json_schema(schema["items"])
    if isinstance(schema.get("additionalProperties"), dict):
        schema["additionalProperties"] = json_schema(schema["additionalProperties"])
    if schema.pop("x-kubernetes-preserve-unknown-fields", False):
        schema["additionalProperties"] = True
    elif schema.get("type") == "object" and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def values_schema(written: str) -> str:
    """The chart's values schema ``written``, with ``examplePool.spec`` the KVCachePool
    spec's schema."""
    values = json.loads(written)
    spec = json_schema(openapi_schema(KVCachePool)["properties"]["spec"])
    spec["description"] = (
        "The KVCachePool spec; its schema is the CRD's (python -m kvpool.operator.crds)."
    )
    values["properties"]["examplePool"]["properties"]["spec"] = spec
    return json.dumps(values, indent=2, ensure_ascii=False) + "\n"


def definition(resource: type[Resource]) -> dict[str, Any]:
    """The CustomResourceDefinition of ``resource``."""
    crd = resource.crd
    version = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "subresources": {"status": {}},
        "additionalPrinterColumns": [column.openapi() for column in crd.printer_columns],
        "schema": {"openAPIV3Schema": openapi_schema(resource)},
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{crd.plural}.{GROUP}", "labels": {NAME_LABEL: APP}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": crd.kind,
                "listKind": f"{crd.kind}List",
                "plural": crd.plural,
                "singular": crd.kind.lower(),
                "shortNames": list(crd.short_names),
                "categories": list(crd.categories),
            },
            "versions": [version],
        },
    }


class _Dumper(yaml.SafeDumper):
    """Block style, lists of a few scalars in flow style, long prose folded; no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)  # a list's items indented under its key


def _text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = ">" if len(text) > 72 and " " in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


def _list(dumper: yaml.SafeDumper, items: list[Any]) -> yaml.SequenceNode:
    flow = len(items) <= 12 and all(isinstance(item, str | int | float) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)


_Dumper.add_representer(str, _text)
_Dumper.add_representer(list, _list)

_HEADER = """\
# The {kind} CustomResourceDefinition. Generated from the model
# {model} by `python -m kvpool.operator.crds`:
# edit the model and run it again, not this file.
# Needs Kubernetes >= 1.29 (CEL validation rules and the quantity library).
"""


def manifest(resource: type[Resource]) -> str:
    """The YAML file of ``resource``'s CRD."""
    crd = definition(resource)
    text = yaml.dump(crd, Dumper=_Dumper, sort_keys=False, width=84, allow_unicode=True)
    if yaml.safe_load(text) != crd:
        raise AssertionError(f"the YAML of {resource.__name__}'s CRD does not read back as written")
    model = f"{resource.__module__}.{resource.__name__}"
    return _HEADER.format(kind=resource.crd.kind, model=model) + text


def files(root: Path) -> dict[Path, str]:
    """Every generated file under ``root`` (the repository) and its text."""
    generated = {}
    for resource in RESOURCES:
        text = manifest(resource)
        for target in TARGETS:
            generated[root / target / f"{resource.crd.plural}.{GROUP}.yaml"] = text
    values = root / VALUES_SCHEMA
    generated[values] = values_schema(values.read_text())
    return generated


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpool.operator.crds",
        description="Write kvpool's CRDs from the models in kvpool.operator.spec.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a committed CRD differs from the models'",
    )
    parser.add_argument(
        "--root", type=Path, default=Path(), help="the repository (default: the current directory)"
    )
    arguments = parser.parse_args(argv)
    stale = {
        path: text
        for path, text in files(arguments.root).items()
        if not path.is_file() or path.read_text() != text
    }
    for path, text in stale.items():
        if arguments.check:
            print(f"{path}: differs from the models; run python -m kvpool.operator.crds")
        else:
            path.write_text(text)
    return 1 if arguments.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
