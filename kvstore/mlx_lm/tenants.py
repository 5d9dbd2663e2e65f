"""Tenants of one ``kvstore serve``: a request's ``cache_salt`` (the name vLLM uses, a
field of the chat and completions request body) keeps its prompt cache apart from
every other salt's, and from requests without one.

:func:`check_salt` checks the field (a non-empty string of at most 4 KiB; absent or
``null`` is no salt, as in vLLM; anything else is a 400 answer); the server's engine sets
the prompt cache's tenant for each request's lookups and inserts
(:meth:`~kvstore.mlx_lm.PersistentPromptCache.set_tenant`).

The salt is kept in memory only; the store sees a keyed hash of it
(:mod:`kvstore.store.tenants`).
"""

from __future__ import annotations

from kvstore.store.tenants import MAX_SALT_BYTES

__all__ = ["FIELD", "check_salt"]

FIELD = "cache_salt"


def check_salt(value: object) -> str | None:
    """The request's salt (None when absent or ``null``: no salt); ValueError when it is not
    a usable one."""
    if value is None:
        return None
    if not isinstance(value, str) or not value \
            or len(value.encode("utf-8", "surrogatepass")) > MAX_SALT_BYTES:
        raise ValueError(f"{FIELD} must be a non-empty string of at most {MAX_SALT_BYTES} "
                         "bytes")
    return value
