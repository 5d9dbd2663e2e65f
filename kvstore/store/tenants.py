"""Tenants of one server: a per-request cache salt (vLLM's ``cache_salt``) as a namespace
of its own, derived from a keyed hash of the salt, so the salt is never written.

Entries of another salt (or of none) are in another namespace: their chain keys
differ from the first block on, so a lookup never finds them. What the root records
is ``<ns>#tenant-<tag>``, where ``tag`` is HMAC-SHA256(key, salt) cut to 128 bits;
the key is ``$KVSTORE_SALT_KEY`` when set (machines that share a remote share it, so
a tenant's entries are found on every one of them), else a random key the root keeps
in its index (made at the first salted request; as private as the root itself).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import TYPE_CHECKING

from ..errors import KVStoreError
from ..schema import TENANT_MARK, Namespace, block_salt

if TYPE_CHECKING:
    from .store import Store

__all__ = ["SALT_KEY_ENV", "MAX_SALT_BYTES", "block_salt", "salt_tag", "tenant_key",
           "tenant_namespace"]  # block_salt: kvstore.schema's, re-exported

SALT_KEY_ENV = "KVSTORE_SALT_KEY"
MAX_SALT_BYTES = 4096
_META_KEY = b"tenant_key"


def tenant_key(store: Store) -> bytes:
    """The key of this store's salt hashes: ``$KVSTORE_SALT_KEY``, else the root's own
    (made once, in one transaction, so concurrent servers of a root agree). A root open
    read-only that has none yet gets a key of this process alone (it holds no salted
    entries, and can save none)."""
    env = os.environ.get(SALT_KEY_ENV)
    if env:
        return env.encode()
    have = store.local.meta(_META_KEY)
    if have is not None:
        return have
    if store.read_only:
        return secrets.token_bytes(32)
    return store.local.meta_if_absent(_META_KEY, secrets.token_bytes(32))


def salt_tag(key: bytes, salt: str) -> str:
    """32 hex characters that name a salt's namespace; the salt cannot be read back."""
    raw = salt.encode("utf-8", "surrogatepass")
    if not salt or len(raw) > MAX_SALT_BYTES:
        raise KVStoreError(f"cache_salt must be 1 to {MAX_SALT_BYTES} bytes, got {len(raw)}")
    return hmac.new(key, raw, hashlib.sha256).hexdigest()[:32]


def tenant_namespace(namespace: Namespace, tag: str) -> Namespace:
    """``namespace`` for the tenant whose salt has ``tag``."""
    return Namespace(model_id=namespace.model_id,
                     config_fingerprint=namespace.config_fingerprint,
                     tokenizer_hash=namespace.tokenizer_hash,
                     ns=f"{namespace.ns}{TENANT_MARK}{tag}")
