"""L2 fixtures: a real S3 endpoint (moto's server, in a subprocess), a fault proxy, tier configs.

Nothing is patched: boto3 talks HTTP to the server on 127.0.0.1, and nothing
in the test process imports moto. AWS credentials exist only in each test's
environment (monkeypatch) and point at nothing real.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import boto3
import pytest

from kvpool.agent.l2 import ObjectKey
from kvpool.agent.l2.buffers import BufferPool
from kvpool.agent.l2.codec import ObjectCodec
from kvpool.common.config import NvmeTierConfig, S3TierConfig
from kvpool.common.keyring import RELOAD_SECONDS, Keyring, generate_key
from kvpool.tools.bench.local.s3_server import moto_server
from tests.support.agent_process import AgentProcess

from .faults import FaultProxy

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MiB = 1 << 20
TENANT = "tenant-a"
POOL = "test-pool"


def chunk(index: int | str, tenant: str = TENANT) -> ObjectKey:
    return ObjectKey(tenant, hashlib.sha256(str(index).encode()).digest())


def payload(size: int, seed: int | str = 0) -> bytes:
    return random.Random(f"{seed}-{size}").randbytes(size)


def write_key(directory: Path, key_id: int, material: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / str(key_id)).write_bytes(material)


def object_codec(
    keys: Path,
    pool: str = POOL,
    *,
    seal: bool = False,
    reload_seconds: float = RELOAD_SECONDS,
    aegis: bool = False,
) -> ObjectCodec:
    """A codec under the master keys in ``keys`` (key 1 generated there if it holds none)."""
    generate_key(keys)
    keyring = Keyring(keys, reload_seconds=reload_seconds)
    return ObjectCodec(keyring, pool, seal=seal, buffers=BufferPool(), aegis=aegis)


def nvme_config(path: Path, **overrides: Any) -> NvmeTierConfig:
    return NvmeTierConfig(**{"path": path, "capacity": 1 << 30, **overrides})


def s3_config(endpoint: str, bucket: str, **overrides: Any) -> S3TierConfig:
    settings: dict[str, Any] = {
        "bucket": bucket,
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "max_concurrency": 8,
        "connect_timeout_seconds": 1.0,
        "read_timeout_seconds": 2.0,
        "multipart_threshold": 8 * MiB,
        "part_size": 5 * MiB,  # S3's smallest part
    }
    return S3TierConfig(**{**settings, **overrides})


def raw_client(endpoint: str) -> S3Client:
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for variable in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ROLE_ARN"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "kvpool-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "kvpool-test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    bucket = f"kvpool-{uuid.uuid4().hex[:16]}"
    raw_client(s3_endpoint).create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    upstream = urlsplit(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    proxy = FaultProxy((upstream.hostname, upstream.port))
    proxy.start()
    yield proxy
    proxy.stop()


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Start real agents, each in its own directory ``name`` (4 MiB of L1 unless set)."""
    started: list[AgentProcess] = []

    def start(name: str, **settings: str) -> AgentProcess:
        workdir = tmp_path / name
        workdir.mkdir(exist_ok=True)
        agent = AgentProcess(workdir, {"L1_SIZE": "4MiB", **settings})
        started.append(agent)
        return agent.start()

    yield start
    for agent in started:
        agent.cleanup()
