"""A pool's shared spaces (``spec.sharedSpaces``): caches its tenants share.

- :mod:`~kvpool_operator.spaces.salts`: each space's salt, in the pool's Secret
  ``kvpool-<pool>-spaces``;
- :mod:`~kvpool_operator.spaces.handout`: the salts in an admitted tenant's Secret
  (``space-<name>``);
- :mod:`~kvpool_operator.spaces.entries`: a space's entries in the pool's tenants and
  quotas ConfigMaps;
- :mod:`~kvpool_operator.spaces.pins`: its pinned prefixes' keys, pinned and warmed on every
  agent;
- :mod:`~kvpool_operator.spaces.status`: the pool status's ``sharedSpaces`` and its
  ``SharedSpaces`` condition;
- :mod:`~kvpool_operator.spaces.reconciler`: when each is done.
"""

from kvpool_operator.spaces.reconciler import SpaceReconciler

__all__ = ["SpaceReconciler"]
