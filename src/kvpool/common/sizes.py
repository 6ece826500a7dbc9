"""Sizes in bytes, as every configuration of kvpool writes them: Kubernetes quantities.

One grammar for the agent's, the index's and the operator's sizes (and the CRDs'): a whole
number of bytes, or a whole number and a unit.

- binary: ``Ki Mi Gi Ti Pi Ei`` (2^10 ... 2^60), and ``KiB MiB GiB TiB PiB EiB`` as the
  same (pydantic's spelling, which kvpool's configurations took before);
- decimal: ``k M G T P E`` (10^3 ... 10^18), as Kubernetes;
- ``KB MB GB TB PB EB`` (and ``K``) are refused: they mean 10^n to SI and 2^n to many a
  reader, and pydantic read ``1GB`` as 10^9 bytes, some 954 MiB, without a word;
- a bare ``B`` (``512B``) is refused, as the CRDs' schema refuses it: write ``512``;
- a size of 2^63 bytes or more (``8Ei``) is refused: no file or mapping is that large;
- a fraction (``1.5Gi``) is refused with the whole quantity to write (``1536Mi``), as the
  CRDs' schema refuses it.

Standard library and pydantic only: the connector and the operator import this module.
"""

from __future__ import annotations

import re
import typing
from fractions import Fraction
from typing import TYPE_CHECKING, Annotated

from pydantic import BeforeValidator, WithJsonSchema

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

BINARY_UNITS = {
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
}
DECIMAL_UNITS = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
UNITS = {**BINARY_UNITS, **DECIMAL_UNITS}
"""Kubernetes' suffixes of a quantity of bytes: what the CRDs' schema admits."""
MAX_SIZE = (1 << 63) - 1
"""The largest size: what an off_t holds (posix_fallocate, mmap)."""
UNIT_PATTERN = "|".join(UNITS)
"""The suffixes as a regular expression's alternation (the CRDs' schema uses it)."""
HELP = (
    "a whole number of bytes, or with a unit: Ki Mi Gi Ti Pi Ei (binary: 2^10, 2^20...), "
    "k M G T P E (decimal: 10^3, 10^6...)"
)

_QUANTITY = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?P<unit>[A-Za-z]*)")
_AMBIGUOUS = {"K": "k", "KB": "k", "MB": "M", "GB": "G", "TB": "T", "PB": "P", "EB": "E"}


class SizeError(ValueError):
    """A size that is not a whole quantity of bytes; the message says what to write."""


def parse_size(value: object) -> int:
    """Bytes of ``value``: an int, or a string such as ``64Mi``, ``1G`` or ``4096``.

    Raises :class:`SizeError` with what to write instead.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise SizeError(f"expected a size, {HELP}; not a {type(value).__name__}")
    if isinstance(value, int):
        if value < 0:
            raise SizeError("a size cannot be negative")
        return _bounded(value)
    text = value.strip()
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise SizeError(f"not a size: expected {HELP}")
    number, unit = match["number"], match["unit"]
    if unit in _AMBIGUOUS:
        binary = "Ki" if unit == "K" else f"{unit[0]}i"
        raise SizeError(
            f"ambiguous unit {unit}: write {number}{_AMBIGUOUS[unit]} "
            f"({_AMBIGUOUS[unit]}: 10^{_exponent(UNITS[_AMBIGUOUS[unit]])}) or "
            f"{number}{binary} ({binary}: 2^{UNITS[binary].bit_length() - 1})"
        )
    if unit.endswith("iB") and unit[:-1] in BINARY_UNITS:
        unit = unit[:-1]  # KiB, MiB...: binary, as pydantic reads them
    if unit not in UNITS and unit != "":
        raise SizeError(f"unknown unit {unit}: expected {HELP}")
    amount = Fraction(number) * UNITS.get(unit, 1)
    if amount.denominator != 1:
        raise SizeError(f"not a whole number of bytes: {number}{unit} is {float(amount)} bytes")
    if "." in number:
        raise SizeError(f"not a whole quantity: write {format_size(int(amount))}")
    return _bounded(int(amount))


def _bounded(size: int) -> int:
    if size > MAX_SIZE:
        raise SizeError("too large: a size is below 2^63 bytes (8Ei)")
    return size


def format_size(size: int) -> str:
    """``size`` as the shortest whole quantity: ``1Gi``, ``512M``, ``1000``."""
    for units in (BINARY_UNITS, DECIMAL_UNITS):
        for unit, factor in reversed(units.items()):
            if size and size % factor == 0:
                return f"{size // factor}{unit}"
    return str(size)


def _exponent(power_of_ten: int) -> int:
    return len(str(power_of_ten)) - 1


class _SizeMarker:
    """Marks a field as a size (the configuration reference shows its default as one)."""

    def __repr__(self) -> str:
        return "Size"


SIZE = _SizeMarker()

Size = Annotated[
    int,
    BeforeValidator(parse_size),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": MAX_SIZE},
                {"type": "string", "pattern": rf"^[0-9]+({UNIT_PATTERN}|[KMGTPE]iB)?$"},
            ]
        }
    ),
    SIZE,
]
"""Bytes, written as a size (``64Mi``, ``1Gi``, ``4096``); read as an int."""


def is_size(field: FieldInfo) -> bool:
    """Whether ``field`` holds a :data:`Size` (``Size``, ``Size | None``)."""
    return any(item is SIZE for item in field.metadata) or _marked(field.annotation)


def _marked(annotation: object) -> bool:
    if typing.get_origin(annotation) is Annotated:
        return any(item is SIZE for item in typing.get_args(annotation)[1:])
    return any(_marked(argument) for argument in typing.get_args(annotation))
