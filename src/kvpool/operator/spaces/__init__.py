"""A pool's shared spaces (``spec.sharedSpaces``): caches its tenants share.

- :mod:`~kvpool.operator.spaces.salts`: each space's salt, in the pool's Secret
  ``kvpool-<pool>-spaces``;
- :mod:`~kvpool.operator.spaces.handout`: the salts in an admitted tenant's Secret
  (``space-<name>``);
- :mod:`~kvpool.operator.spaces.entries`: a space's entries in the pool's tenants and
  quotas ConfigMaps;
- :mod:`~kvpool.operator.spaces.pins`: its pinned prefixes' keys, pinned and warmed on every
  agent;
- :mod:`~kvpool.operator.spaces.status`: the pool status's ``sharedSpaces`` and its
  ``SharedSpaces`` condition;
- :mod:`~kvpool.operator.spaces.reconciler`: when each is done.
"""

from kvpool.operator.spaces.reconciler import SpaceReconciler

__all__ = ["SpaceReconciler"]
