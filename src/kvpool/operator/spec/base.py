"""What every part of the resources' models shares: the API's names, the model base, byte
quantities, Secret references and the wording of a validation error."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel

from kvpool.common.names import API_GROUP, POOL_PLURAL
from kvpool.common.names import API_VERSION as GROUP_VERSION
from kvpool.common.sizes import UNIT_PATTERN, parse_size
from kvpool.operator.spec.markers import CustomResource

GROUP = API_GROUP
VERSION = GROUP_VERSION
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KVCachePool"
PLURAL = POOL_PLURAL
TENANT_KIND = "KVCacheTenant"
TENANT_PLURAL = "kvcachetenants"


class InvalidSpec(ValueError):
    """The pool's spec cannot be turned into children; the message names the fields."""


def parse_bytes(value: object) -> int:
    """A whole quantity of bytes as the CRD spells it (``64Gi``, ``512M``, ``4096``): the
    agent's own reading of a size (:func:`kvpool.common.sizes.parse_size`)."""
    return parse_size(value)


def _bytes(pattern: str) -> WithJsonSchema:
    return WithJsonSchema({"type": "string", "pattern": pattern, "maxLength": 32})


Bytes = Annotated[int, BeforeValidator(parse_bytes), _bytes(f"^(0|[1-9][0-9]*({UNIT_PATTERN})?)$")]
"""Bytes, written as a whole quantity (``0``, ``512M``, ``8Gi``); read as an int."""
PositiveBytes = Annotated[
    int, BeforeValidator(parse_bytes), _bytes(f"^[1-9][0-9]*({UNIT_PATTERN})?$")
]
"""Bytes the CRD refuses to be 0."""
PAGE_SIZES = ("4Ki", "8Ki", "16Ki", "32Ki", "64Ki", "128Ki", "256Ki", "512Ki", "1Mi", "2Mi", "4Mi")
PageSize = Annotated[
    int, BeforeValidator(parse_bytes), WithJsonSchema({"type": "string", "enum": list(PAGE_SIZES)})
]
"""One of the page sizes the CRD admits."""
Quantity = Annotated[
    int | str,
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
            r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
        }
    ),
]
"""A Kubernetes resource quantity (``250m``, ``2Gi``, ``4``), passed on as written."""
Int64 = Annotated[int, Field(json_schema_extra={"format": "int64"})]
Metadata = Annotated[dict[str, Any], WithJsonSchema({"type": "object"})]
"""An object's metadata: the API server's to check, not the CRD's."""


class SpecModel(BaseModel):
    """A part of a resource, read from its camelCase fields; unknown fields are errors."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True
    )


class SecretRef(SpecModel):
    name: str = Field(
        description="Name of the Secret, in the pool's namespace.",
        json_schema_extra={"maxLength": 253},
    )


def describe(error: ValidationError, root: str) -> str:
    """One line per problem, each naming its field from ``root``."""
    return "; ".join(
        f"{'.'.join([root, *(str(part) for part in problem['loc'])])}: {problem['msg']}"
        for problem in error.errors()
    )


class Resource(SpecModel):
    """What every kvpool resource has beside its spec and status."""

    crd: ClassVar[CustomResource]

    api_version: str | None = Field(
        None, description="Versioned schema of this representation of an object."
    )
    kind: str | None = Field(None, description="REST resource this object represents.")
    metadata: Metadata | None = None
