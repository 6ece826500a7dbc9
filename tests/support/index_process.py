"""A real ``kvpool-index`` process for tests (:mod:`kvpool.tools.bench.local.index_process`)
with the tests' tokens and fingerprint."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvpool.common.keys import ModelFingerprint, tenant_id
from kvpool.tools.bench.local.index_process import Endpoints
from kvpool.tools.bench.local.index_process import IndexProcess as BenchIndex

GATEWAY_TOKEN = "gateway-token-for-tests-7e3a91c4f05b2d68"
ADMIN_TOKEN = "index-admin-token-for-tests-c28f4b61e9a703d5"
TENANT_TOKEN = "tenant-token-for-tests-19d6e2a8b47f0c53"
FINGERPRINT = ModelFingerprint("test-model", "bfloat16", "NHD", chunk_tokens=16)
SALT = "alice-salt"


class IndexProcess(BenchIndex):
    def __init__(
        self,
        workdir: Path,
        agents: Mapping[str, Endpoints],
        settings: Mapping[str, str] | None = None,
        *,
        tokens_file: bool = True,
    ) -> None:
        """``settings`` become KVPOOL_INDEX_* environment variables (a ``FINGERPRINT`` among
        them replaces :data:`FINGERPRINT`); without ``tokens_file`` the index generates its
        admin token into ``workdir/state``."""
        tokens = {
            "admins": [ADMIN_TOKEN],
            "gateways": [GATEWAY_TOKEN],
            "tenants": {tenant_id(SALT): TENANT_TOKEN},
        }
        fingerprint = {
            "model": FINGERPRINT.model,
            "dtype": FINGERPRINT.dtype,
            "kv_layout": FINGERPRINT.kv_layout,
            "chunk_tokens": FINGERPRINT.chunk_tokens,
        }
        super().__init__(workdir, agents, fingerprint, tokens if tokens_file else None, settings)
