"""The vLLM connector under its old module path: ``kv_connector_module_path:
"kvpool_agent.connector"`` keeps working. New configurations name :mod:`kvpool.connector`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.connector.facade import KvpoolConnector

__all__ = ["KvpoolConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvpoolConnector":
        from kvpool.connector.facade import KvpoolConnector

        return KvpoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
