"""The Kubernetes operator (``kvpool-operator``, ``pip install 'kvpool[operator]'``, kopf):
reconciles KVCachePools and KVCacheTenants into node agents, the index, Services,
ConfigMaps, RBAC and NetworkPolicies, and serves the admission webhook that wires engine
pods. Public surface: :func:`kvpool.operator.main.main` and the resources' models in
:mod:`kvpool.operator.spec` (``python -m kvpool.operator.crds`` writes the CRDs from them)."""

__version__ = "0.1.0"
