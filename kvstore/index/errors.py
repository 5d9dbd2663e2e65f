"""The index's own error (the exported ones it raises, such as ``IndexLockLostError``, are in
:mod:`kvstore.errors`)."""

from __future__ import annotations

from ..errors import KVStoreError


class IndexStoreError(KVStoreError):
    """An LMDB operation failed (wraps :class:`lmdb.Error`)."""
