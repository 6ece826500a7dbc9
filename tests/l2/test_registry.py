"""The L2 registry: every registered adapter imports and is named as registered."""

from __future__ import annotations

import inspect

import pytest

from kvpool.agent.l2 import ADAPTER_NAMES, L2Adapter, adapter_class


@pytest.mark.parametrize("name", ADAPTER_NAMES)
def test_every_registered_adapter_imports_and_has_the_contract(name: str) -> None:
    adapter = adapter_class(name)
    assert adapter.name == name
    for method in ("put", "get", "exists", "delete", "close"):
        assert inspect.iscoroutinefunction(getattr(adapter, method)), method
        assert inspect.signature(getattr(adapter, method)).parameters.keys() == (
            inspect.signature(getattr(L2Adapter, method)).parameters.keys()
        )


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown L2 tier 'tape'; known tiers are nvme, s3"):
        adapter_class("tape")
