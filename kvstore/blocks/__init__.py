"""The block-store seam (:class:`base.BlockStore`) and its backends: local files, S3.

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
from .local import LocalBlockStore, open_real_dir

__all__ = [
    "ALGORITHMS",
    "BlockStat",
    "BlockCheck",
    "BlockStore",
    "LocalBlockStore",
    "Digest",
    "HexDigest",
    "check_digest",
    "from_hex",
    "hash_bytes",
    "new_hasher",
    "open_real_dir",
    "to_hex",
]
