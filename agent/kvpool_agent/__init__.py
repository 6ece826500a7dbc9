"""kvpool node agent: the L1 shared-memory cache, its service, client and vLLM connector."""

__version__ = "0.1.0"
