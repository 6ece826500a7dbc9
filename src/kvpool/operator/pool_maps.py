"""Single keys of a pool's ConfigMaps (its tenants and quotas ConfigMaps), each written with
a JSON merge patch of that key only, so that writers of different keys never overwrite each
other's."""

from __future__ import annotations

from collections.abc import Mapping

from kvpool.operator.apply import KINDS, ApiError, Cluster
from kvpool.operator.render import Pool

CONFIG_MAPS = KINDS["v1", "ConfigMap"]


class PoolMaps:
    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    def data(self, pool: Pool, config_map: str) -> dict[str, str] | None:
        """The data of one of the pool's ConfigMaps; None if it does not exist."""
        found = self._cluster.get(CONFIG_MAPS, pool.namespace, config_map)
        data: dict[str, str] | None = None if found is None else found.get("data") or {}
        return data

    def set_key(self, pool: Pool, config_map: str, key: str, value: str | None) -> None:
        """One key of one of the pool's ConfigMaps (None removes it), if it differs. A
        ConfigMap the pool has not made yet is an :class:`ApiError` (retried)."""
        data = self.data(pool, config_map)
        if data is None and value is None:
            return
        if data is None:
            raise ApiError(f"the pool's ConfigMap {config_map} does not exist yet", 404)
        self.patch_key(pool, config_map, data, key, value)

    def patch_key(
        self, pool: Pool, config_map: str, data: Mapping[str, str], key: str, value: str | None
    ) -> None:
        """One key of a ConfigMap whose ``data`` was just read, if it differs."""
        if data.get(key) != value:
            self._cluster.patch(CONFIG_MAPS, pool.namespace, config_map, {"data": {key: value}})
