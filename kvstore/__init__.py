"""kvstore: a persistent, shared, deduplicated KV-cache store for MLX models."""

from .errors import KVStoreError

__all__ = ["KVStoreError"]
