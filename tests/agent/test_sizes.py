"""One reading of a size for every configuration: Kubernetes quantities."""

from __future__ import annotations

import re

import pytest
from pydantic import BaseModel, ByteSize

from kvpool.common.config import AgentConfig
from kvpool.common.index_config import IndexConfig
from kvpool.common.problems import nested_model
from kvpool.common.sizes import SizeError, format_size, is_size, parse_size
from kvpool.connector.settings import ConnectorSettings
from kvpool.operator.spec import parse_bytes


@pytest.mark.parametrize(
    ("written", "size"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("0", 0),
        ("64Ki", 64 << 10),
        ("64Mi", 64 << 20),
        ("1Gi", 1 << 30),
        ("2Ti", 2 << 40),
        ("1Pi", 1 << 50),
        ("1Ei", 1 << 60),
        ("1k", 1000),
        ("64M", 64 * 10**6),
        ("1G", 10**9),
        ("3T", 3 * 10**12),
        ("1P", 10**15),
        ("1E", 10**18),
        ("64KiB", 64 << 10),  # pydantic's spelling, which the README used: binary
        ("64MiB", 64 << 20),
        ("1GiB", 1 << 30),
        (" 8Gi ", 8 << 30),
    ],
)
def test_quantities(written: object, size: int) -> None:
    assert parse_size(written) == size
    assert parse_bytes(written) == size  # the operator reads them the same way


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("1GB", "ambiguous unit GB: write 1G (G: 10^9) or 1Gi (Gi: 2^30)"),
        ("64MB", "ambiguous unit MB: write 64M (M: 10^6) or 64Mi (Mi: 2^20)"),
        ("4KB", "ambiguous unit KB: write 4k (k: 10^3) or 4Ki (Ki: 2^10)"),
        ("4K", "ambiguous unit K: write 4k"),
        ("1.5Gi", "not a whole quantity: write 1536Mi"),
        ("0.5", "not a whole number of bytes"),
        ("64mi", "unknown unit mi"),
        ("512B", "unknown unit B"),
        ("8Ei", "too large: a size is below 2^63 bytes"),
        (1 << 63, "too large"),
        ("99999999999999999999999999", "too large"),
        ("64 Mi", "not a size"),
        ("-1Gi", "not a size"),
        ("lots", "not a size"),
        ("", "not a size"),
        (-1, "cannot be negative"),
        (1.5, "not a float"),
        (True, "not a bool"),
    ],
)
def test_refusals_say_what_to_write(written: object, message: str) -> None:
    with pytest.raises(SizeError, match=re.escape(message)):
        parse_size(written)


@pytest.mark.parametrize(
    ("size", "shown"),
    [(0, "0"), (1000, "1k"), (1 << 30, "1Gi"), (1536 << 20, "1536Mi"), (10**9, "1G"), (7, "7")],
)
def test_format_size_is_read_back(size: int, shown: str) -> None:
    assert format_size(size) == shown
    assert parse_size(shown) == size


def _size_fields(model: type[BaseModel], prefix: str = "") -> dict[str, bool]:
    found = {}
    for name, field in model.model_fields.items():
        nested = nested_model(field.annotation)
        if nested is not None:
            found |= _size_fields(nested, f"{prefix}{name}.")
        elif "ByteSize" in str(field.annotation) or is_size(field):
            found[prefix + name] = is_size(field)
    return found


def test_every_size_field_reads_quantities() -> None:
    agent = _size_fields(AgentConfig)
    assert agent == dict.fromkeys(
        [
            "l1_size",
            "page_size",
            "default_tenant_quota",
            "default_pin_budget",
            "http_limits.max_body_bytes",
            "http_limits.max_head_bytes",
            "max_inline_bytes",
            "zmq_limits.receive_budget",
            "nvme.capacity",
            "s3.multipart_threshold",
            "s3.part_size",
            "peers.max_bytes_in_flight",
            "peers.bandwidth",
        ],
        True,
    )
    assert _size_fields(IndexConfig) == dict.fromkeys(
        ["http_limits.max_body_bytes", "http_limits.max_head_bytes", "picker.max_body_bytes"], True
    )
    assert _size_fields(ConnectorSettings) == {}
    config = AgentConfig(
        l1_size="64Mi", default_tenant_quota="1G", nvme={"path": "/x", "capacity": "1Ti"}
    )  # type: ignore[arg-type]
    assert (config.l1_size, config.default_tenant_quota) == (64 << 20, 10**9)
    assert config.nvme is not None and config.nvme.capacity == 1 << 40
    assert not isinstance(config.l1_size, ByteSize)
