"""The block-store seam: bytes by digest, whatever holds them (local files, an object store).

A backend subclasses :class:`BlockStore` and passes the shared suite in
``tests/blocks/blockstore_suite.py`` (docs/ARCHITECTURE.md, "A block backend").
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from ..errors import CorruptBlockError
from .hashing import Digest, new_hasher

Buffer = bytes | memoryview


class BlockStat(NamedTuple):
    """A stored block's size in bytes and its modification time (seconds since the epoch)."""

    size: int
    mtime: float


class BlockStore(abc.ABC):
    """Immutable, content-addressed blocks; knows nothing of tokens or caches."""

    algo: str  # "blake3" | "sha256"

    @abc.abstractmethod
    def put(self, digest: bytes, pieces: Sequence[Buffer]) -> bool:
        """Store the concatenation of ``pieces`` under ``digest``; True if written now.

        An existing block is not rewritten (backends freshen its age where they can).
        """

    @abc.abstractmethod
    def get(self, digest: bytes, *, verify: bool = True) -> bytes:
        """The block's bytes: BlockNotFoundError if missing, CorruptBlockError on a mismatch."""

    @abc.abstractmethod
    def exists(self, digest: bytes) -> bool:
        """Whether the block is stored."""

    @abc.abstractmethod
    def delete(self, digest: bytes) -> bool:
        """Remove the block; False if it was already gone."""

    @abc.abstractmethod
    def iter(self) -> Iterator[Digest]:
        """Every stored block's digest, in no particular order."""

    @abc.abstractmethod
    def stat(self, digest: bytes) -> BlockStat | None:
        """The block's size and age, or None if it is missing."""

    @abc.abstractmethod
    def where(self, digest: bytes) -> str:
        """Where the block is kept (a path or a URL), for messages."""

    def check(self, digest: bytes, data: Buffer) -> None:
        """Raise CorruptBlockError when ``data`` does not hash to ``digest``."""
        h = new_hasher(self.algo)
        h.update(data)
        got = h.digest()
        if got != digest:
            raise CorruptBlockError(self.where(digest), digest.hex(), got.hex(),
                                    digest=digest.hex())

    def read_into(self, digest: bytes, offset: int, out: memoryview) -> None:
        """Copy ``len(out)`` bytes of the block, from ``offset``, into ``out`` (verified)."""
        data = self.get(digest)
        end = offset + len(out)
        if offset < 0 or end > len(data):
            raise ValueError(
                f"block {digest.hex()}: range [{offset}, {end}) outside its {len(data)} bytes"
            )
        out[:] = data[offset:end]
