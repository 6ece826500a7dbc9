"""Real agents of a pool for the operator's tests: ``kvpool-agent`` processes that watch the
pool's tenants and quota ConfigMaps on the emulated API server, each with an NVMe tier."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import pytest

from kvpool.operator.render import Pool
from tests.operator.cluster_view import config_map
from tests.support.agent_process import AgentProcess
from tests.support.kube_api import ServedApi
from tests.support.polling import eventually


@contextlib.contextmanager
def pool_agents(
    api: ServedApi,
    pool: Pool,
    http_port: int,
    addresses: Sequence[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[AgentProcess]]:
    """One agent per address, at the pool's http port, started once the operator has made
    the pool's ConfigMaps."""
    eventually(lambda: config_map(api, pool.namespace, pool.tenants_name))
    started: list[AgentProcess] = []
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("KUBECONFIG", str(api.kubeconfig()))
            for address in addresses:
                workdir = tmp_path_factory.mktemp("agent")
                settings = {
                    "HOST": address,
                    "HTTP_PORT": str(http_port),
                    "L1_SIZE": "16MiB",
                    "TENANTS_CONFIGMAP": f"{pool.namespace}/{pool.tenants_name}",
                    "QUOTA_CONFIGMAP": f"{pool.namespace}/{pool.quotas_name}",
                    "NVME__PATH": str(workdir / "nvme"),
                    "NVME__CAPACITY": "64MiB",
                }
                started.append(AgentProcess(workdir, settings))
                started[-1].start()
        yield started
    finally:
        for process in started:
            process.cleanup()
