from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: the whole flow from kubectl apply to a KV hit in vLLM (a few minutes)"
    )
