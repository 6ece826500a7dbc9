"""The salts of a pool's shared spaces: minted by the operator, one key per space name in the
pool's Secret ``kvpool-<pool>-spaces`` (owned by the pool, deleted with it). A space's salt is
never in a log line, an event, a status or a ConfigMap: only there and in the Secrets of the
tenants the space admits."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.operator.apply import SECRETS, Cluster
from kvpool.operator.b64 import decoded, encoded
from kvpool.operator.bearer import mint
from kvpool.operator.render import Pool
from kvpool.operator.render.objects import manifest

COMPONENT = "spaces"


def space_salts(cluster: Cluster, pool: Pool, names: Sequence[str]) -> dict[str, str]:
    """The salt of each space of ``names`` (minted for a new one); the salts of spaces no
    longer declared leave the Secret. No Secret is made for a pool without spaces."""
    found = cluster.get(SECRETS, pool.namespace, pool.spaces_name)
    kept = decoded(found)
    salts = {name: kept.get(name) or mint() for name in names}
    changes: dict[str, str | None] = {
        name: salt for name, salt in salts.items() if kept.get(name) != salt
    }
    changes |= {name: None for name in kept if name not in salts}
    if found is None and salts:
        owned = manifest("v1", "Secret", pool, pool.spaces_name, component=COMPONENT)
        cluster.create(SECRETS, {**owned, "type": "Opaque", "data": encoded(salts)})
    elif found is not None and changes:
        cluster.patch(SECRETS, pool.namespace, pool.spaces_name, {"data": encoded(changes)})
    return salts
