"""kvstore: a persistent, shared, deduplicated KV-cache store for MLX models.

The store and the file functions import MLX and mlx-lm, which takes about a
second; they are loaded on first use so ``kvstore --help`` stays instant.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    BlockNotFoundError,
    CacheMismatchError,
    CorruptBlockError,
    EntryNotFoundError,
    ForkedProcessError,
    IndexLockLostError,
    InvalidDigestError,
    InvalidNamespaceError,
    InvalidTokensError,
    KVStoreError,
    NamespaceRequiredError,
    NotAStoreError,
    ReadOnlyStoreError,
    RootPermissionError,
    RootSettingsError,
    StoreFullError,
    UnknownCacheTypeError,
    UnsafeRootError,
    UnsupportedDtypeError,
)
from .formats.errors import FileFormatError
from .schema import Namespace

if TYPE_CHECKING:
    from .formats.v3 import Loaded, load_v3, save_v3
    from .formats.v5file import save_v5
    from .store import Entry, EntryInfo, Match, Stats, Store, default_root

_LAZY = {
    "Entry": "store",
    "EntryInfo": "store",
    "Match": "store",
    "Stats": "store",
    "Store": "store",
    "default_root": "store",
    "Loaded": "formats.v3",
    "load_v3": "formats.v3",
    "save_v3": "formats.v3",
    "save_v5": "formats.v5file",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "BlockNotFoundError",
    "CacheMismatchError",
    "CorruptBlockError",
    "Entry",
    "EntryInfo",
    "EntryNotFoundError",
    "FileFormatError",
    "ForkedProcessError",
    "IndexLockLostError",
    "InvalidDigestError",
    "InvalidNamespaceError",
    "InvalidTokensError",
    "KVStoreError",
    "Loaded",
    "Match",
    "Namespace",
    "NamespaceRequiredError",
    "NotAStoreError",
    "ReadOnlyStoreError",
    "RootPermissionError",
    "RootSettingsError",
    "Stats",
    "Store",
    "StoreFullError",
    "UnknownCacheTypeError",
    "UnsafeRootError",
    "UnsupportedDtypeError",
    "default_root",
    "load_v3",
    "save_v3",
    "save_v5",
]
