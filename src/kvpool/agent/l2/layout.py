"""Where a chunk lives inside a tier: ``<tenant>/<first 2 hex of key>/<key hex>``.

Both tiers use this one layout (NVMe as a relative path, S3 as the end of the
object key), so a tenant's objects share a prefix and the 2-hex shard spreads
them over 256 directories or S3 prefixes. Names that do not fit the layout (a
tenant that could escape its directory or overflow the object header, a key
that is not a chunk key) are refused by the adapters per key.
"""

from __future__ import annotations

import re

from kvpool.agent.l2.base import ObjectKey
from kvpool.common.keys import KEY_BYTES

# At most 32 bytes (the header's tenant field); no leading dot, so never "." / ".."
# and never a hidden or temporary file's name.
_TENANT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,31}")


def is_valid(name: ObjectKey) -> bool:
    return len(name.key) == KEY_BYTES and is_valid_tenant(name.tenant)


def is_valid_tenant(tenant: str) -> bool:
    """Whether ``tenant`` names a directory / prefix of the layout (others hold no objects)."""
    return _TENANT.fullmatch(tenant) is not None


def tenant_prefix(tenant: str) -> str:
    """Where every object of ``tenant`` lives (a valid tenant's: see :func:`is_valid_tenant`)."""
    return f"{tenant}/"


def relative_path(name: ObjectKey) -> str:
    digest = name.key.hex()
    return f"{name.tenant}/{digest[:2]}/{digest}"
