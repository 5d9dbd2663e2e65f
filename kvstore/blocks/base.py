"""The block-store seam: bytes by digest, whatever holds them (local files, an object store).

:class:`BlockStore` is what every caller uses (the save's writer, the restore's reader,
verify, repair, GC, the pulls and pushes between tiers): a backend implements the
primitives (``_put``, ``get``, ``exists``, ``_delete``, ``iter``, ``stat``, ``where``)
and inherits a default for the rest, overriding what it can do better (a local root
stages a block in a temp file and links it into place; an object store reads many
blocks at once). Writes go through one check of ``read_only``. Every backend passes
the shared suite in ``tests/blocks/blockstore_suite.py`` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import abc
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import BlockNotFoundError, CorruptBlockError, ReadOnlyStoreError
from .hashing import Digest, hash_bytes, new_hasher

Buffer = bytes | memoryview


class BlockStat(NamedTuple):
    """A stored block's size in bytes and its modification time (seconds since the epoch)."""

    size: int
    mtime: float


@dataclass(frozen=True)
class Staged:
    """A block's bytes written aside, not yet visible under its name: :meth:`BlockStore.publish`
    makes them so, :meth:`BlockStore.discard` drops them. A store that writes files keeps a
    temp file (``path``); one that writes on publish keeps the ``pieces``."""

    pieces: Sequence[Buffer] = ()
    path: str = ""
    size: int = 0


class BlockStore(abc.ABC):
    """Immutable, content-addressed blocks; knows nothing of tokens or caches."""

    algo: str  # "blake3" | "sha256"
    read_only: bool = False
    durable: bool = False  # whether a published block survives a crash of the machine

    # --- what a backend implements ----------------------------------------------------

    @abc.abstractmethod
    def _put(self, digest: bytes, pieces: Sequence[Buffer]) -> bool:
        """Store the concatenation of ``pieces`` under ``digest`` unless it is there."""

    @abc.abstractmethod
    def _delete(self, digest: bytes) -> bool:
        """Remove the block; False if it was already gone."""

    @abc.abstractmethod
    def get(self, digest: bytes, *, verify: bool = True) -> bytes:
        """The block's bytes: BlockNotFoundError if missing, CorruptBlockError on a mismatch."""

    @abc.abstractmethod
    def exists(self, digest: bytes) -> bool:
        """Whether the block is stored."""

    @abc.abstractmethod
    def iter(self) -> Iterator[Digest]:
        """Every stored block's digest, in no particular order."""

    @abc.abstractmethod
    def stat(self, digest: bytes) -> BlockStat | None:
        """The block's size and age, or None if it is missing."""

    @abc.abstractmethod
    def where(self, digest: bytes) -> str:
        """Where the block is kept (a path or a URL), for messages."""

    # --- writes: ``read_only`` is checked here, once -------------------------------------

    def check_writable(self) -> None:
        """ReadOnlyStoreError when this store may not be written."""
        if self.read_only:
            raise ReadOnlyStoreError(f"{self.where_all()} is open read-only")

    def where_all(self) -> str:
        """Where the store keeps its blocks, for messages."""
        return type(self).__name__

    def put(self, digest: bytes, pieces: Sequence[Buffer]) -> bool:
        """Store the concatenation of ``pieces`` under ``digest``; True if written now.

        An existing block is not rewritten (:meth:`freshen` it to protect it from GC).
        """
        self.check_writable()
        return self._put(digest, pieces)

    def put_many(self, blocks: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        """:meth:`put` of each ``(digest, pieces)`` as it comes (a stream: nothing is kept
        once written), in a batch where the backend can (a local root syncs the new files
        together); which were written now."""
        self.check_writable()
        return [self._put(d, pieces) for d, pieces in blocks]

    def delete(self, digest: bytes) -> bool:
        """Remove the block; False if it was already gone."""
        self.check_writable()
        return self._delete(digest)

    def delete_many(self, digests: Sequence[bytes]) -> list[bytes]:
        """Remove many blocks (in batched requests where the backend can); those that were
        there (a block gone already, removed by another process meanwhile, is skipped)."""
        self.check_writable()
        return [d for d in digests if self._delete(d)]

    def freshen(self, digest: bytes) -> bool:
        """Mark an existing block as just used, so a grace period spares it; False if it is
        missing. A store that cannot change a block's age (an object store) only says
        whether it is there."""
        self.check_writable()
        return self.exists(digest)

    def stage(self, pieces: Sequence[Buffer], *, sync: bool = False) -> Staged:
        """Write a new block's bytes aside, invisible until :meth:`publish` (the first half of
        a put, so a caller can hash and write many blocks before it names any). ``sync``:
        make the bytes durable now, else :meth:`sync_staged` does later."""
        self.check_writable()
        return Staged(pieces=list(pieces), size=sum(len(p) for p in pieces))

    def sync_staged(self, staged: Staged) -> None:
        """Make staged bytes durable (many of them can be synced at once, on threads)."""
        return None  # the default stages in memory: publish makes them durable

    def publish(self, staged: Staged, digest: bytes) -> bool:
        """Make staged bytes the block ``digest``; never replaces an existing block. True when
        this call created it. The staged bytes are gone afterwards, whatever happens."""
        self.check_writable()
        try:
            return self._put(digest, staged.pieces)
        finally:
            self.discard(staged)

    def discard(self, staged: Staged) -> None:
        """Drop staged bytes that will not be published (a failed save)."""
        return None  # in memory: nothing to remove

    def sync_published(self, digests: Iterable[bytes]) -> None:
        """Make the names of blocks just published durable (a local root fsyncs the
        directories that hold them), before a catalog commits references to them."""
        return None  # the default's put is durable when it returns

    def quarantine(self, digest: bytes) -> str | None:
        """Take a block found bad out of use; where it went (None: it was gone). The default
        deletes it; a store with room for it moves it aside."""
        self.check_writable()
        where = self.where(digest)
        return where if self._delete(digest) else None

    # --- reads ------------------------------------------------------------------------

    def check(self, digest: bytes, data: Buffer) -> None:
        """Raise CorruptBlockError when ``data`` does not hash to ``digest``."""
        h = new_hasher(self.algo)
        h.update(data)
        got = h.digest()
        if got != digest:
            raise CorruptBlockError(self.where(digest), digest.hex(), got.hex(),
                                    digest=digest.hex())

    def get_many(self, digests: Sequence[bytes], sizes: Mapping[bytes, int] | None = None
                 ) -> Iterator[tuple[bytes, bytes]]:
        """``(digest, bytes)`` of each block, each verified (a backend may fetch them at once).

        ``sizes``: what each block should hold; a backend that reads from elsewhere refuses
        a larger object unread (a CorruptBlockError), so no one who can write it makes a
        reader hold more than that."""
        for d in digests:
            yield d, self.get(d)

    def iter_stats(self) -> Iterator[tuple[Digest, BlockStat]]:
        """Every block with its size and age (a block gone meanwhile is skipped)."""
        for d in self.iter():
            st = self.stat(d)
            if st is not None:
                yield d, st

    def read_into(self, digest: bytes, offset: int, out: memoryview) -> None:
        """Copy ``len(out)`` bytes of the block, from ``offset``, into ``out`` (verified)."""
        data = self.get(digest)
        end = offset + len(out)
        if offset < 0 or end > len(data):
            raise ValueError(
                f"block {digest.hex()}: range [{offset}, {end}) outside its {len(data)} bytes"
            )
        out[:] = data[offset:end]

    def open(self, digest: bytes, size: int | None = None) -> int:
        """A read-only file descriptor of the block's bytes (the caller closes it), for reads
        that go straight into memory (``preadv``). A missing block is a BlockNotFoundError;
        one of the wrong ``size`` a CorruptBlockError. The default copies the (unverified)
        bytes into an anonymous temp file; the caller's reads verify them."""
        data = self.get(digest, verify=False)
        if size is not None and len(data) != size:
            raise CorruptBlockError(self.where(digest), f"{size} bytes", f"{len(data)} bytes",
                                    digest=digest.hex())
        f = tempfile.TemporaryFile()
        try:
            f.write(data)
            f.flush()
            return os.dup(f.fileno())
        finally:
            f.close()

    def hash_stored(self, digest: bytes) -> bytes:
        """The digest of the block's bytes as stored (unverified)."""
        return hash_bytes(self.algo, self.get(digest, verify=False))

    def _misstated(self, digest: bytes, actual: int, size: int) -> tuple[str, str, int]:
        """:meth:`inspect`'s verdict on a block of ``actual`` bytes asked for as ``size``:
        'sized' when its bytes hash to ``digest`` (the size is a manifest's lie), else
        'corrupt'."""
        try:
            good = self.hash_stored(digest) == digest
        except (BlockNotFoundError, CorruptBlockError):
            good = False
        if good:
            return "sized", f"{actual} bytes hashing to its name, not {size}", actual
        return "corrupt", f"{actual} bytes, not {size}", 0

    def inspect(self, digest: bytes, size: int, *, read_data: bool) -> tuple[str, str, int]:
        """``(state, what is wrong, bytes hashed)`` of one block: state is 'ok', 'missing',
        'corrupt' (the wrong size, or with ``read_data`` bytes that do not hash to
        ``digest``) or 'sized': of another size than ``size`` but hashing to ``digest``, a
        good block that a manifest misstates (a block of another size is always hashed)."""
        st = self.stat(digest)
        if st is None:
            return "missing", "no block", 0
        if st.size != size:
            return self._misstated(digest, st.size, size)
        if not read_data:
            return "ok", "", 0
        try:
            data = self.get(digest, verify=False)
        except BlockNotFoundError:
            return "missing", "no block", 0
        h = new_hasher(self.algo)
        h.update(data)
        got = h.digest()
        if got != digest:
            return "corrupt", f"bytes hashing to {got.hex()}", len(data)
        return "ok", "", len(data)
