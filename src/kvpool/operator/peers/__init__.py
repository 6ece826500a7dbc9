"""A pool's peer credential (``spec.peers``): the keys with which its agents prove to each
other that they are the pool's, and seal the chunks they send each other.

- :mod:`~kvpool.operator.peers.rotation`: which keys the pool's Secret holds after a pass,
  and when each was made (pure);
- :mod:`~kvpool.operator.peers.keys`: the Secret ``kvpool-<pool>-peer`` itself: made,
  rotated, deleted.
"""

from kvpool.operator.peers.keys import PeerKeys

__all__ = ["PeerKeys"]
