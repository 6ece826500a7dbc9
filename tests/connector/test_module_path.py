"""``kvpool_agent.connector``, the module path users' vLLM configurations name, still
gives kvpool's connector."""

from __future__ import annotations

import importlib

import pytest


def test_the_old_module_path_names_the_same_connector() -> None:
    pytest.importorskip("vllm")
    old = importlib.import_module("kvpool_agent.connector")
    new = importlib.import_module("kvpool.connector")
    assert old.KvpoolConnector is new.KvpoolConnector


def test_the_old_module_path_loads_no_engine_until_asked() -> None:
    old = importlib.import_module("kvpool_agent.connector")
    assert old.__all__ == ["KvpoolConnector"]
    with pytest.raises(AttributeError):
        _ = old.NoSuchConnector
