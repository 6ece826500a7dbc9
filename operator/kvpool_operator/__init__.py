"""kvpool operator: reconciles KVCachePool resources into node agents (kopf)."""

__version__ = "0.1.0"
