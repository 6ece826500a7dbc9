"""Label selectors, as Kubernetes writes and reads them (less ``ipBlock`` and friends)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal, Self

from pydantic import ConfigDict, Field, WithJsonSchema, model_validator

from kvpool.operator.spec.base import SpecModel
from kvpool.operator.spec.markers import ATOMIC, Rule, cel

SELECTOR_VALUES = "matchExpressions: In and NotIn need values, Exists and DoesNotExist take none"

LabelValue = Annotated[
    str,
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": 63,
            "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
        }
    ),
]


class LabelSelectorRequirement(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "(self.operator == 'In' || self.operator == 'NotIn') == "
                "(has(self.values) && self.values.size() > 0)",
                SELECTOR_VALUES,
            )
        )
    )

    key: str = Field(description="Label key.", json_schema_extra={"minLength": 1, "maxLength": 317})
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the label's value is matched.",
        json_schema_extra={"maxLength": 12},  # bounds the CEL rule's cost
    )
    values: tuple[Annotated[str, WithJsonSchema({"type": "string", "maxLength": 63})], ...] = Field(
        default_factory=tuple,
        description="Values of In and NotIn.",
        json_schema_extra={"maxItems": 64} | ATOMIC,
    )

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> Self:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError(SELECTOR_VALUES)
        return self


class LabelSelector(SpecModel):
    match_labels: dict[str, LabelValue] = Field(
        default_factory=dict,
        description="Labels that it has, by key.",
        json_schema_extra={"maxProperties": 32},
    )
    match_expressions: tuple[LabelSelectorRequirement, ...] = Field(
        default_factory=tuple,
        description="Requirements on its labels.",
        json_schema_extra={"maxItems": 16} | ATOMIC,
    )

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether an object with ``labels`` is selected, as Kubernetes reads a selector."""
        return all(labels.get(key) == value for key, value in self.match_labels.items()) and all(
            _holds(requirement, labels) for requirement in self.match_expressions
        )


def _holds(requirement: LabelSelectorRequirement, labels: Mapping[str, str]) -> bool:
    present = requirement.key in labels
    match requirement.operator:
        case "In":
            return present and labels[requirement.key] in requirement.values
        case "NotIn":
            return not present or labels[requirement.key] not in requirement.values
        case "Exists":
            return present
        case "DoesNotExist":
            return not present
