"""The local tier's own error (the exported ones it raises are in :mod:`kvstore.errors`,
the index's in :mod:`kvstore.index.errors`)."""

from __future__ import annotations

from ..errors import KVStoreError


class UnsupportedFilesystemError(KVStoreError, OSError):
    """The root lies on a filesystem where LMDB locking is unsafe (NFS, CIFS)."""


__all__ = ["UnsupportedFilesystemError"]
