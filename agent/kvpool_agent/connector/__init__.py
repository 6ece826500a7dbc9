"""The vLLM connector: vLLM engines share KV through the node's kvpool agent.

Use it with::

    --kv-transfer-config '{"kv_connector": "KvpoolConnector",
                           "kv_connector_module_path": "kvpool_agent.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"pool": "main"}}'

Modules, from the edge inwards:

* ``facade`` -- ``KvpoolConnector``, the class vLLM loads; delegates only;
* ``scheduler`` -- the scheduler half: lookups, load and store planning;
* ``worker`` -- the worker half: copies between vLLM's blocks and the segment;
* ``layout`` -- the KV cache understood by shape and stride; the chunk byte format;
* ``copier`` -- the copy primitive (CPU, and CUDA from pageable chunk files);
* ``staged`` -- the CUDA copies, through staging slabs;
* ``inline`` -- chunks in the agent's messages, for a pod that cannot map the segment;
* ``link`` -- the line to the agent: timeouts, pauses, reconnects, warnings;
* ``discovery``, ``settings`` -- where the agent is and how to talk to it;
* ``jobs`` -- what the halves exchange, as plain data; ``metadata`` -- the same as vLLM's types;
* ``counters``, ``metrics`` -- what the halves count.

Importing this package does not import vLLM; ``KvpoolConnector`` does, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool_agent.connector.facade import KvpoolConnector

__all__ = ["KvpoolConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvpoolConnector":
        from kvpool_agent.connector.facade import KvpoolConnector

        return KvpoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
