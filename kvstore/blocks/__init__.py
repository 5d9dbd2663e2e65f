"""Content-addressed block files: hashing, atomic writes, reads."""

from .hashing import (
    ALGORITHMS,
    Digest,
    HexDigest,
    check_digest,
    from_hex,
    hash_bytes,
    new_hasher,
    to_hex,
)
from .local import BlockStore, open_real_dir

__all__ = [
    "ALGORITHMS",
    "BlockStore",
    "Digest",
    "HexDigest",
    "check_digest",
    "from_hex",
    "hash_bytes",
    "new_hasher",
    "open_real_dir",
    "to_hex",
]
