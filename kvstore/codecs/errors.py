"""The codecs' own error (``UnknownCacheTypeError``, which ``kvstore`` exports, is in
:mod:`kvstore.errors`)."""

from __future__ import annotations

from ..errors import KVStoreError


class UnknownKindError(KVStoreError, KeyError):
    """A manifest names a layer kind that no codec is registered for."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown kind"
