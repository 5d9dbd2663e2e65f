"""The store's own error (the exported ones it raises are in :mod:`kvstore.errors`)."""

from __future__ import annotations

from ..errors import KVStoreError


class TierTimeoutError(KVStoreError, TimeoutError):
    """A tier below this machine's root did not answer within its bound (a lookup, a pull)."""
