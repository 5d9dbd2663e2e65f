"""The store's own error (the exported ones it raises are in :mod:`kvstore.errors`)."""

from __future__ import annotations

from ..errors import KVStoreError


class UnsupportedFilesystemError(KVStoreError, OSError):
    """The root lies on a filesystem where LMDB locking is unsafe (NFS, CIFS)."""
