"""``spec.sharedSpaces`` of a pool: what the CRD and the operator's model admit, and the
one-line errors that name the field of what they refuse."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator.spec import API_VERSION, KIND, InvalidSpec, PoolSpec
from tests.support.crd_schema import admission_errors, schema

QUOTA = {"l1": "1Gi"}


def _pool(*spaces: dict[str, Any]) -> dict[str, Any]:
    spec = {"sharedSpaces": list(spaces)}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "main"}, "spec": spec}


def _refused(spec: dict[str, Any]) -> str:
    with pytest.raises(InvalidSpec) as refusal:
        PoolSpec.parse(spec)
    message = str(refusal.value)
    assert "\n" not in message
    return message


def test_a_space_takes_the_defaults() -> None:
    (space,) = PoolSpec.parse(_pool({"name": "docs", "quota": QUOTA})["spec"]).shared_spaces
    assert (space.quota.l1, space.quota.nvme_bytes, space.pin_budget) == (1 << 30, 1 << 30, 0)
    assert (space.allowed_namespaces, space.owners, space.pinned) == ((), (), ())
    assert admission_errors(_pool({"name": "docs", "quota": QUOTA})) == []
    pin = {"name": "p", "tokens": [1, 2]}
    (pinned,) = (
        PoolSpec.parse(
            _pool({"name": "docs", "quota": QUOTA, "pinBudget": "1Mi", "pinned": [pin]})["spec"]
        )
        .shared_spaces[0]
        .pinned
    )
    assert (pinned.tokens, pinned.warm) == ((1, 2), True)


INVALID = [
    pytest.param(
        {"name": "docs", "quota": QUOTA, "allowedNamespaces": ["a"], "owners": ["a", "b"]},
        "spec.sharedSpaces.0.owners: Value error, owners must each be in allowedNamespaces; "
        "b is not",
        "sharedSpaces[].owners must each be in allowedNamespaces",
        id="owner-not-allowed",
    ),
    pytest.param(
        {"name": "docs", "quota": {"l1": "lots"}},
        "spec.sharedSpaces.0.quota.l1: Value error, not a size",
        "does not match",
        id="quota-not-a-size",
    ),
    pytest.param(
        {"name": "docs"},
        "spec.sharedSpaces.0.quota: Field required",
        "'quota' is a required property",
        id="quota-missing",
    ),
    pytest.param(
        {"name": "docs", "quota": {"nvme": "1Gi"}},
        "spec.sharedSpaces.0.quota.l1: Field required",
        "'l1' is a required property",
        id="quota-without-l1",
    ),
    pytest.param(
        {"name": "Docs", "quota": QUOTA},
        "spec.sharedSpaces.0.name: String should match pattern",
        "does not match",
        id="name-not-a-dns-label",
    ),
    pytest.param(
        {"name": "docs", "quota": QUOTA, "allowedNamespaces": ["Team_A"]},
        "spec.sharedSpaces.0.allowedNamespaces.0: String should match pattern",
        "does not match",
        id="namespace-not-a-name",
    ),
    pytest.param(
        {"name": "docs", "quota": QUOTA, "pinned": [{"name": "p", "tokens": [1]}]},
        "spec.sharedSpaces.0.pinned: Value error, pinned needs a pinBudget above 0",
        "sharedSpaces[].pinned needs a pinBudget above 0",
        id="pins-without-budget",
    ),
    pytest.param(
        {"name": "docs", "quota": QUOTA, "pinned": [{"name": "p", "tokens": [1 << 32]}]},
        "spec.sharedSpaces.0.pinned.0.tokens.0: Input should be less than or equal to 4294967295",
        "is greater than the maximum of 4294967295",
        id="token-id-above-uint32",
    ),
    pytest.param(
        {"name": "docs", "quota": QUOTA, "pinned": [{"name": "p", "tokens": []}]},
        "spec.sharedSpaces.0.pinned.0.tokens: Tuple should have at least 1 item",
        "should be non-empty",
        id="no-tokens",
    ),
]


@pytest.mark.parametrize(("space", "message", "crd_message"), INVALID)
def test_invalid_spaces_are_refused_by_the_crd_and_the_model(
    space: dict[str, Any], message: str, crd_message: str
) -> None:
    assert _refused(_pool(space)["spec"]).startswith(message)
    errors = admission_errors(_pool(space))
    assert any(crd_message in error for error in errors), errors


def test_names_are_unique_among_spaces_and_among_a_spaces_pins() -> None:
    space = {"name": "docs", "quota": QUOTA}
    assert _refused(_pool(space, {**space, "quota": {"l1": "2Gi"}})["spec"]) == (
        "spec.sharedSpaces: Value error, names must be unique; docs is given more than once"
    )
    pins = [{"name": "p", "tokens": [1]}, {"name": "p", "tokens": [2]}]
    assert _refused(_pool({**space, "pinBudget": "1Mi", "pinned": pins})["spec"]) == (
        "spec.sharedSpaces.0.pinned: Value error, names must be unique; p is given more than once"
    )
    # the API server keys both lists by name: it refuses a name given twice itself
    spaces = schema()["properties"]["spec"]["properties"]["sharedSpaces"]
    assert (spaces["x-kubernetes-list-type"], spaces["x-kubernetes-list-map-keys"]) == (
        "map",
        ["name"],
    )
    pinned = spaces["items"]["properties"]["pinned"]
    assert (pinned["x-kubernetes-list-type"], pinned["x-kubernetes-list-map-keys"]) == (
        "map",
        ["name"],
    )
