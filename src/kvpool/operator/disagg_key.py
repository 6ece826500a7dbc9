"""The disaggregation key Secret ``kvpool-<pool>-pd-key`` of a pool with
``spec.index.picker.disaggregation``: the endpoint picker signs its choice of a prefill pod
with it, and the decode pods' sidecars verify that choice with it, so that no client can
point a sidecar at an address of its own (docs/operations/disaggregation.md).

Made with a random key (32 bytes, hex) before the index that mounts it; given a new key when
``keyGeneration`` changes (recorded on the Secret in
:data:`~kvpool.operator.render.config.PD_KEY_GENERATION_ANNOTATION`), or when what it holds
is too short to sign with; deleted when the pool stops disaggregating. Owned by the pool
(the garbage collector takes it with the pool). The key is never in a log line, an event,
a status or a ConfigMap: only there and in the index's and the sidecars' mounts of it.

It stays in the pool's namespace: the picker routes only pods of that namespace, so that
is where every decode pod that can be sent a prefill header runs.
"""

from __future__ import annotations

import secrets

from kvpool.common.disagg import MIN_KEY_BYTES
from kvpool.operator.apply import SECRETS, Cluster
from kvpool.operator.b64 import decoded, encoded
from kvpool.operator.render import Pool
from kvpool.operator.render.config import PD_KEY, PD_KEY_GENERATION_ANNOTATION
from kvpool.operator.render.objects import manifest

COMPONENT = "pd-key"


class DisaggregationKey:
    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    def keep(self, pool: Pool, generation: int) -> list[str]:
        """Make the pool's Secret, or give it a new key for a new ``generation``; what
        changed, in words (no key)."""
        name, wanted = pool.pd_key_name, str(generation)
        found = self._cluster.get(SECRETS, pool.namespace, name)
        annotations = {PD_KEY_GENERATION_ANNOTATION: wanted}
        data = encoded({PD_KEY: secrets.token_hex(MIN_KEY_BYTES)})
        if found is None:
            owned = manifest(
                "v1", "Secret", pool, name, component=COMPONENT, annotations=annotations
            )
            self._cluster.create(SECRETS, {**owned, "type": "Opaque", "data": data})
            return [f"created Secret {name} with disaggregation key {wanted}"]
        recorded = ((found.get("metadata") or {}).get("annotations") or {}).get(
            PD_KEY_GENERATION_ANNOTATION
        )
        held = decoded(found).get(PD_KEY, "").strip()
        if recorded == wanted and len(held) >= MIN_KEY_BYTES:
            return []
        patch = {"metadata": {"annotations": annotations}, "data": data}
        self._cluster.patch(SECRETS, pool.namespace, name, patch)
        return [f"replaced the key of Secret {name} with disaggregation key {wanted}"]

    def remove(self, pool: Pool) -> list[str]:
        """Delete the pool's Secret (if the pool owns it); what changed, in words."""
        name = pool.pd_key_name
        deleted = self._cluster.delete_owned(SECRETS, pool.namespace, name, pool.uid)
        return [f"deleted Secret {name}"] if deleted else []
