"""The block-store seam (:class:`base.BlockStore`) and what its backends share (the local
files are ``kvstore.local.blocks``, the S3 objects ``kvstore.remote.blocks``).

Blocks are bytes named by their digest; nothing here knows of tokens or caches.
"""


from .base import BlockStat, BlockStore
from .check import BlockCheck
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

__all__ = [
    "ALGORITHMS",
    "BlockStat",
    "BlockCheck",
    "BlockStore",
    "Digest",
    "HexDigest",
    "check_digest",
    "from_hex",
    "hash_bytes",
    "new_hasher",
    "to_hex",
]
