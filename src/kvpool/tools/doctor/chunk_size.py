"""The chunk-size check: a chunk is a whole number of vLLM blocks, or the connector caches
nothing (it refuses the layout and logs "not a multiple of the block size")."""

from __future__ import annotations

from kvpool.common.names import CHUNK_TOKENS_ANNOTATION, CONNECTOR_CHUNK_TOKENS_ENV
from kvpool.tools.doctor.report import Check, failed, passed, skipped

NAME = "chunk-size"


def check_chunk_size(chunk_tokens: int | None, block_size: int | None) -> Check:
    if block_size is None:
        return skipped(NAME, "no --block-size given (vLLM's --block-size)")
    if chunk_tokens is None:
        return skipped(
            NAME,
            "the chunk size is not advertised (an endpoint, or a Service without "
            f"{CHUNK_TOKENS_ANNOTATION}): set {CONNECTOR_CHUNK_TOKENS_ENV} as the connector "
            "would take it",
        )
    if chunk_tokens % block_size:
        multiple = -(-chunk_tokens // block_size) * block_size
        return failed(
            NAME,
            f"{chunk_tokens}-token chunks are not a multiple of vLLM's {block_size}-token "
            "blocks: the connector caches nothing",
            f"make the pool's spec.chunkTokens (or the connector's chunk_tokens) a multiple "
            f"of {block_size}, such as {multiple}",
        )
    return passed(
        NAME, f"{chunk_tokens}-token chunks: {chunk_tokens // block_size} blocks of {block_size}"
    )
