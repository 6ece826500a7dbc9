"""The vLLM connector: vLLM engines share KV through the node's kvpool agent.

Use it with::

    --kv-transfer-config '{"kv_connector": "KvpoolConnector",
                           "kv_connector_module_path": "kvpool.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"pool": "main"}}'

Modules, from the edge inwards:

* ``facade`` -- ``KvpoolConnector``, the class vLLM loads; delegates only;
* ``scheduler`` -- ``KVPoolConnectorScheduler``, the scheduler side, composed of
  ``scheduler_requests`` (the request tracker), ``scheduler_lookups`` (lookups and
  prefetches), ``scheduler_loads`` (the load of a hit), ``scheduler_stores`` (store
  planning) and ``scheduler_access`` (the tenants the engine's token may act for);
* ``worker`` -- ``KVPoolConnectorWorker``, the worker side, composed of ``worker_transport``
  (chunk files or messages), ``worker_loads`` and ``worker_stores`` (the copies);
* ``layout`` -- the KV cache understood by shape and stride; the chunk byte format;
* ``copier`` -- the copy primitive (CPU, and CUDA from pageable chunk files);
* ``staged`` -- the CUDA copies, through staging slabs;
* ``inline`` -- chunks in the agent's messages, for a pod that cannot map the segment;
* ``link`` -- the line to the agent: timeouts, pauses, reconnects, warnings;
* ``discovery``, ``settings`` -- where the agent is and how to talk to it;
* ``jobs`` -- what the halves exchange, as plain data; ``metadata`` -- the same as vLLM's types
  (``KVPoolConnectorMetadata`` and its kin);
* ``counters``, ``metrics`` -- what the halves count.

Public surface: ``KvpoolConnector`` and its settings (``settings``); every other module is
the connector's own (docs/architecture.md, "Public surfaces").

Importing this package does not import vLLM; ``KvpoolConnector`` does, on first use.
Configurations that name the old path, ``kvpool_agent.connector``, load the same class.
"""

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
