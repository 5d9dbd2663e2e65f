"""kvstore: a persistent, shared, deduplicated KV-cache store for MLX models."""

from .errors import (
    BlockNotFoundError,
    CacheMismatchError,
    CorruptBlockError,
    EntryNotFoundError,
    InvalidDigestError,
    InvalidTokensError,
    KVStoreError,
    NamespaceRequiredError,
    NotAStoreError,
    RootSettingsError,
    UnknownCacheTypeError,
)
from .schema import Namespace
from .store import Entry, EntryInfo, Match, Stats, Store, default_root

__all__ = [
    "BlockNotFoundError",
    "CacheMismatchError",
    "CorruptBlockError",
    "Entry",
    "EntryInfo",
    "EntryNotFoundError",
    "InvalidDigestError",
    "InvalidTokensError",
    "KVStoreError",
    "Match",
    "Namespace",
    "NamespaceRequiredError",
    "NotAStoreError",
    "RootSettingsError",
    "Stats",
    "Store",
    "UnknownCacheTypeError",
    "default_root",
]
