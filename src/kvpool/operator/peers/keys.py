"""The peer Secret ``kvpool-<pool>-peer`` of a pool with peers: made with a first key before
the agents that mount it, rotated when due (:mod:`~kvpool.operator.peers.rotation`), deleted
when the pool turns peers off. Owned by the pool (the garbage collector takes it with the
pool). Its keys are never in a log line, an event, a status or a ConfigMap: only there and
in the agents' mounts of it.

Two callers, one lock (both read, then write the Secret): the pool's reconcile, on each
change, and a daemon per pool with peers, every ``--usage-seconds``
(:meth:`PeerKeys.refresh`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kvpool.operator.apply import SECRETS, Cluster
from kvpool.operator.b64 import decoded, encoded
from kvpool.operator.events import PoolEvents
from kvpool.operator.peers.rotation import CREATED_ANNOTATION, PeerKeyring
from kvpool.operator.render import Pool
from kvpool.operator.render.objects import manifest
from kvpool.operator.spec import InvalidSpec, PeersSpec, PoolSpec

COMPONENT = "peer"


class PeerKeys:
    def __init__(self, cluster: Cluster, events: PoolEvents) -> None:
        self._cluster = cluster
        self._events = events
        self._lock = threading.Lock()

    def keep(self, pool: Pool, peers: PeersSpec, now: datetime) -> list[str]:
        """Make the pool's Secret with key 1, or add and drop keys as a pass at ``now``
        does; what changed, in words (no key)."""
        with self._lock:
            return self._keep(pool, peers, now)

    def remove(self, pool: Pool) -> list[str]:
        """Delete the pool's Secret (if the pool owns it); what changed, in words."""
        with self._lock:
            deleted = self._cluster.delete_owned(SECRETS, pool.namespace, pool.peer_name, pool.uid)
        return [f"deleted Secret {pool.peer_name}"] if deleted else []

    def refresh(self, body: Mapping[str, Any]) -> None:
        """:meth:`keep` for the pool as it is now (``body``, kopf's live view of it: read
        under the lock, so that a pool that just turned peers off is left alone), with an
        event when the keys changed."""
        with self._lock:
            try:
                spec = PoolSpec.parse(body.get("spec") or {})
            except InvalidSpec:
                return  # the pool's reconcile reports it
            if not spec.peers.enabled:
                return
            metadata = body["metadata"]
            pool = Pool(metadata["name"], metadata["namespace"], metadata["uid"])
            changes = self._keep(pool, spec.peers, datetime.now(UTC))
        if changes:
            self._events.peer_keys_rotated(body, "; ".join(changes))

    def _keep(self, pool: Pool, peers: PeersSpec, now: datetime) -> list[str]:
        name = pool.peer_name
        found = self._cluster.get(SECRETS, pool.namespace, name)
        values = decoded(found)
        annotations = ((found or {}).get("metadata") or {}).get("annotations") or {}
        recorded = annotations.get(CREATED_ANNOTATION)
        keys = PeerKeyring.read(values, recorded, now).rotated(now, peers.credential_rotation)
        wanted = keys.values()
        if found is None:
            owned = manifest(
                "v1",
                "Secret",
                pool,
                name,
                component=COMPONENT,
                annotations={CREATED_ANNOTATION: keys.annotation()},
            )
            self._cluster.create(SECRETS, {**owned, "type": "Opaque", "data": encoded(wanted)})
            return [f"created Secret {name} with peer key {max(keys.keys)}"]
        changes = {
            key: wanted.get(key)
            for key in values.keys() | wanted.keys()
            if values.get(key) != wanted.get(key)
        }
        if changes or recorded != keys.annotation():
            annotated = {"annotations": {CREATED_ANNOTATION: keys.annotation()}}
            patch = {"metadata": annotated, "data": encoded(changes)}
            self._cluster.patch(SECRETS, pool.namespace, name, patch)
        return _described(name, changes)


def _described(name: str, changes: Mapping[str, str | None]) -> list[str]:
    """The keys added to and dropped from the Secret ``name``, by id (never a value)."""
    ids = sorted(changes, key=lambda key: (len(key), key))
    added = [f"added peer key {key} to Secret {name}" for key in ids if changes[key]]
    return added + [f"dropped peer key {key} from Secret {name}" for key in ids if not changes[key]]
