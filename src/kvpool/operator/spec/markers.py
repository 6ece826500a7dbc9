"""What a model says about its CustomResourceDefinition beyond its JSON schema.

A model's fields give the CRD its properties, types, defaults, bounds and descriptions
(``kvpool.operator.crds`` turns the JSON schema pydantic makes into a structural schema).
What JSON schema cannot say is declared next to the fields it is about, with these:

- CEL rules (``x-kubernetes-validations``): :func:`cel` of :class:`Rule` objects, as a
  model's ``model_config = ConfigDict(json_schema_extra=cel(...))`` (the rule's ``self`` is
  the object) or as a field's ``Field(json_schema_extra=cel(...))`` (``self`` is the value);
- list semantics: :data:`ATOMIC`, :data:`SET` and :func:`list_map` in a field's
  ``json_schema_extra``;
- a resource's names and ``kubectl get`` columns: a :class:`CustomResource` as the
  resource model's ``crd`` class variable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import JsonValue

JsonDict = dict[str, JsonValue]


@dataclass(frozen=True)
class Rule:
    """A CEL validation rule: ``rule`` must hold; ``message`` (or the CEL expression
    ``message_expression``) is what the API server answers when it does not."""

    rule: str
    message: str = ""
    message_expression: str = ""

    def __post_init__(self) -> None:
        if bool(self.message) == bool(self.message_expression):
            raise ValueError(f"the rule {self.rule!r} needs a message or a message_expression")

    def openapi(self) -> JsonDict:
        if self.message_expression:
            return {"rule": self.rule, "messageExpression": self.message_expression}
        return {"rule": self.rule, "message": self.message}


def cel(*rules: Rule) -> JsonDict:
    """The ``x-kubernetes-validations`` of a model or a field."""
    return {"x-kubernetes-validations": [rule.openapi() for rule in rules]}


ATOMIC: JsonDict = {"x-kubernetes-list-type": "atomic"}
"""A list that a write replaces whole (server-side apply does not merge its items)."""
SET: JsonDict = {"x-kubernetes-list-type": "set"}
"""A list of unique scalars (the API server refuses one given twice)."""


def list_map(*keys: str) -> JsonDict:
    """A list of objects that server-side apply merges by ``keys`` (conditions by type)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


@dataclass(frozen=True)
class PrinterColumn:
    """A column of ``kubectl get``; ``priority`` 1 shows it with ``-o wide`` only."""

    name: str
    type: Literal["string", "integer", "number", "boolean", "date"]
    json_path: str
    description: str = ""
    priority: int = 0

    def openapi(self) -> JsonDict:
        column: JsonDict = {"name": self.name, "type": self.type}
        if self.priority:
            column["priority"] = self.priority
        if self.description:
            column["description"] = self.description
        column["jsonPath"] = self.json_path
        return column


AGE = PrinterColumn("Age", "date", ".metadata.creationTimestamp")


@dataclass(frozen=True)
class CustomResource:
    """A resource's names (its kind is the model's, its group and version the package's)
    and the columns ``kubectl get`` shows."""

    kind: str
    plural: str
    short_names: tuple[str, ...]
    printer_columns: tuple[PrinterColumn, ...]
    categories: tuple[str, ...] = ("kvpool",)
