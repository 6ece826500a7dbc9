"""The tiny random-weight models of the real-engine tests: see
:mod:`kvpool.tools.bench.local.models`
(shipped with the package, because ``kvpool bench windows`` writes them too)."""

from kvpool.tools.bench.local.models import (
    FAMILIES,
    TINY_DEEPSEEK,
    TINY_GEMMA3,
    TINY_LLAMA,
    TINY_MISTRAL,
    WINDOW,
    write_model,
)

__all__ = [
    "FAMILIES",
    "TINY_DEEPSEEK",
    "TINY_GEMMA3",
    "TINY_LLAMA",
    "TINY_MISTRAL",
    "WINDOW",
    "write_model",
]
