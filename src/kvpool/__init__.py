"""kvpool: a managed, tiered KV cache for vLLM on Kubernetes, one package per component.

Components (each imports only :mod:`kvpool.common` and :mod:`kvpool.client` below it, and
none imports another; ``make lint`` checks it, ``docs/architecture.md`` draws it):

* :mod:`kvpool.agent` -- the node agent (``kvpool-agent``, extra ``agent``);
* :mod:`kvpool.connector` -- the vLLM KV connector, inside vLLM (the base install);
* :mod:`kvpool.index` -- the pool-wide prefix index (``kvpool-index``, extra ``index``);
* :mod:`kvpool.csi` -- the CSI node plugin (``kvpool-csi``, extra ``csi``);
* :mod:`kvpool.operator` -- the Kubernetes operator (``kvpool-operator``, extra ``operator``).

Libraries below them: :mod:`kvpool.client` (the agent's client library, the base install)
and :mod:`kvpool.common` (the contracts every part shares). Above them all,
:mod:`kvpool.tools`: ``kvpool`` (tenant ids, the doctor, the benchmarks).
"""

__version__ = "0.1.0"
