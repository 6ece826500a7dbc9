"""kvpool's CRDs' schemas (the pool's by default), and any CRD's (:func:`object_errors`),
applied as an API server applies them, without one.

- Structural defaulting: a ``default`` fills an absent property, and the defaults inside
  it apply in turn (so ``default: {}`` on an object defaults its fields).
- OpenAPI validation with jsonschema, draft 4 (OpenAPI 3.0's boolean
  ``exclusiveMinimum``/``exclusiveMaximum``). An object schema with properties but no
  ``additionalProperties`` or ``x-kubernetes-preserve-unknown-fields`` refuses unknown
  fields, as kubectl's default strict field validation does; ``x-kubernetes-int-or-string``
  takes an integer or a string.
- CEL rules (``x-kubernetes-validations``) with cel-python: ``self`` is typed by the
  schema (``number`` is a double, ``integer`` an int), ``message`` or
  ``messageExpression`` words a failure, and the Kubernetes quantity library's
  ``quantity()`` and ``asInteger()`` (the only ones the CRD uses) are provided.

Not evaluated: transition rules (those that read ``oldSelf``: an API server skips them on
create, and these checks are of new objects), CEL cost limits, the other
Kubernetes CEL libraries, and ``metadata`` beyond what ``self.metadata.name`` reads.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml
from celpy import celtypes
from kubernetes.utils import parse_quantity

OLDEST_KUBERNETES = "1.29"
"""The oldest Kubernetes with everything the CRD uses (CEL rules, the quantity library)."""
CRD_PATH = Path(__file__).parents[2] / "crds" / "kvcachepools.kvpool.io.yaml"
TENANT_CRD_PATH = CRD_PATH.parent / "kvcachetenants.kvpool.io.yaml"
GAIE_CRD_PATH = Path(__file__).with_name("gaie") / "inference.networking.k8s.io_inferencepools.yaml"
"""The Gateway API Inference Extension's InferencePool CRD (v1.5.0), as its project ships it."""
EXAMPLES = sorted((CRD_PATH.parent / "examples").glob("*.yaml"))
GPU_EXAMPLE = CRD_PATH.parent / "examples" / "gpu-nodes.yaml"
"""The example that sets (nearly) every field."""
Schema = dict[str, Any]


@cache
def crd(path: Path = CRD_PATH) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def schema(path: Path = CRD_PATH) -> Schema:
    (version,) = crd(path)["spec"]["versions"]
    result: Schema = version["schema"]["openAPIV3Schema"]
    return result


def with_defaults(node: Schema, value: Any) -> Any:
    """``value`` with the schema's defaults filled in."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for name, child in node.get("properties", {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = with_defaults(child, value[name])
    elif isinstance(value, list) and "items" in node:
        value = [with_defaults(node["items"], item) for item in value]
    return value


def _strict(node: Schema) -> Schema:
    """The schema as jsonschema reads it, refusing unknown fields."""
    converted = {key: value for key, value in node.items() if not key.startswith("x-kubernetes")}
    if node.get("x-kubernetes-int-or-string"):
        converted["type"] = ["integer", "string"]
    if "properties" in node:
        converted["properties"] = {k: _strict(v) for k, v in node["properties"].items()}
        if "additionalProperties" not in node and not node.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            converted["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        converted["additionalProperties"] = _strict(node["additionalProperties"])
    if "items" in node:
        converted["items"] = _strict(node["items"])
    return converted


def schema_errors(obj: dict[str, Any], path: Path = CRD_PATH) -> list[str]:
    """OpenAPI problems of a defaulted object, as ``path: message``."""
    return _schema_errors(schema(path), obj)


def _schema_errors(node: Schema, obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(_strict(node))
    return [
        f"{'.'.join(str(part) for part in error.absolute_path)}: {error.message}"
        for error in validator.iter_errors(obj)
    ]


def _quantity(text: celtypes.StringType) -> celtypes.IntType:
    return celtypes.IntType(int(parse_quantity(str(text))))


def _as_integer(quantity: celtypes.IntType) -> celtypes.IntType:
    return quantity


_ENVIRONMENT = celpy.Environment()
_FUNCTIONS = {"quantity": _quantity, "asInteger": _as_integer}


@cache
def _program(expression: str) -> celpy.Runner:
    return _ENVIRONMENT.program(_ENVIRONMENT.compile(expression), functions=_FUNCTIONS)


def _to_cel(node: Schema, value: Any) -> Any:
    if isinstance(value, dict) and "properties" in node:
        return celtypes.MapType(
            {
                celtypes.StringType(k): _to_cel(node["properties"].get(k, {}), v)
                for k, v in value.items()
            }
        )
    if isinstance(value, list) and "items" in node:
        return celtypes.ListType([_to_cel(node["items"], item) for item in value])
    if node.get("type") == "number":
        return celtypes.DoubleType(float(value))
    return celpy.json_to_cel(value)


def rule_errors(obj: dict[str, Any], path: Path = CRD_PATH) -> list[str]:
    """Failed CEL rules of a defaulted object, as ``path: message``."""
    return _rule_errors(schema(path), obj, "")


def _rule_errors(node: Schema, value: Any, path: str) -> list[str]:
    errors = []
    for rule in node.get("x-kubernetes-validations", ()):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: not evaluated on create
        context = {"self": _to_cel(node, value)}
        if not bool(_program(rule["rule"]).evaluate(context)):
            message = (
                str(_program(rule["messageExpression"]).evaluate(context))
                if "messageExpression" in rule
                else rule["message"]
            )
            errors.append(f"{path or '<root>'}: {message}")
    if isinstance(value, dict):
        for name, child in node.get("properties", {}).items():
            if name in value:
                errors += _rule_errors(child, value[name], f"{path}.{name}".lstrip("."))
    elif isinstance(value, list) and "items" in node:
        for index, item in enumerate(value):
            errors += _rule_errors(node["items"], item, f"{path}[{index}]")
    return errors


def admission_errors(obj: dict[str, Any], path: Path = CRD_PATH) -> list[str]:
    """What an API server would refuse ``obj`` for: schema problems, then failed rules."""
    return object_errors(schema(path), obj)


def object_errors(node: Schema, obj: dict[str, Any]) -> list[str]:
    """What an API server would refuse ``obj`` for against the openAPIV3Schema ``node`` (a
    CRD version's): its defaulted copy's schema problems, then its failed rules."""
    defaulted = with_defaults(node, obj)
    return _schema_errors(node, defaulted) or _rule_errors(node, defaulted, "")
