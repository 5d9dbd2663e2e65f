"""The index's own error (the exported ones it raises, such as ``IndexLockLostError``, are in
:mod:`kvstore.errors`)."""

from __future__ import annotations

from ..errors import KVStoreError


class IndexStoreError(KVStoreError):
    """An LMDB operation failed (wraps :class:`lmdb.Error`)."""


class IndexBusyError(IndexStoreError, TimeoutError):
    """The index's write lock was held past the wait allowed (``$KVSTORE_LOCK_TIMEOUT``);
    the message names the holder. Nothing was written."""
