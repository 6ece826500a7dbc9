"""Open the configured L2 tiers, fastest first (NVMe, then S3), under the pool's keys."""

from __future__ import annotations

from collections.abc import Callable

from kvpool.agent.l2 import L2Adapter, ObjectKey, adapter_class
from kvpool.agent.l2.buffers import BufferPool
from kvpool.agent.l2.codec import ObjectCodec
from kvpool.common.config import AgentConfig, make_setting_directory
from kvpool.common.files import Undo
from kvpool.common.keyring import Keyring, generate_key


def open_tiers(
    config: AgentConfig,
    limit_of: Callable[[str], int | None],
    pinned: Callable[[ObjectKey], bool],
    undo: Undo | None = None,
) -> list[L2Adapter]:
    """The tiers; :class:`~kvpool.common.keyring.KeyringError` if the keys are unusable.
    ``limit_of`` is each tenant's NVMe quota, ``pinned`` whether a chunk is pinned in L1
    (NVMe evicts neither past its quota nor pinned). A key generated here is noted in
    ``undo``."""
    if config.nvme is None and config.s3 is None:
        return []
    # nvme.path is made (or refused) with the agent's lock on its tree, before a key is made
    key_dir = config.resolved_l2_key_dir
    make_setting_directory(("l2_key_dir",), key_dir, what="L2 key directory")
    generated = generate_key(key_dir)
    if generated is not None and undo is not None:
        undo.file(generated)
    keyring = Keyring(key_dir)
    buffers = BufferPool()
    tiers: list[L2Adapter] = []
    if config.nvme is not None:
        codec = ObjectCodec(keyring, config.pool, seal=config.nvme.encryption, buffers=buffers)
        tiers.append(adapter_class("nvme")(config.nvme, config.pool, limit_of, codec, pinned))  # type: ignore[call-arg]
    if config.s3 is not None:
        codec = ObjectCodec(keyring, config.pool, seal=config.s3.encryption, buffers=buffers)
        tiers.append(adapter_class("s3")(config.s3, config.pool, codec))  # type: ignore[call-arg]
    return tiers
