"""Verified reads: each block's digest checked over the very bytes a reader read.

A restore reads a block's bytes straight into the memory of the arrays it fills,
one share of the block per tensor, from several threads and in whatever order
MLX evaluates the tensors. :class:`BlockCheck` hashes each block in file order
as its bytes arrive: a piece that continues what was hashed is hashed at once,
by the thread that has just read it (the bytes are still in its cache); a piece
that arrives early waits (as a view, no copy) until the bytes before it are in.
Nothing is read twice.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from .hashing import Hasher, new_hasher

Buffer = bytes | memoryview


@dataclass
class _Slot:
    digest: bytes
    size: int
    hasher: Hasher
    done: int = 0  # bytes hashed so far, from the start of the block
    waiting: list[tuple[int, int, Sequence[Buffer]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    failed: str = ""  # why the block cannot be trusted, set by a reader
    settled: bool = False  # read whole and found to hash to its name (:meth:`settle`)


class BlockCheck:
    """Digests of the blocks one read uses, each computed over the bytes it read.

    ``blocks`` lists (digest, size) per slot: a slot is one use of a block by the
    read (an entry listing the same block twice has two slots). With
    ``hashing=False`` (an unverified read, for raw speed) only the failures a
    reader reports are kept.
    """

    def __init__(
        self, algo: str, blocks: Sequence[tuple[bytes, int]], *, hashing: bool = True,
        tail: bytes = b"",
    ) -> None:
        self.hashing = hashing
        # the last bytes of every block (a salted entry's salt, which its manifest gives):
        # hashed after what was read, which stops before them
        self._tail = tail
        self._slots = [_Slot(d, size, new_hasher(algo)) for d, size in blocks]
        self._seq = itertools.count()

    @property
    def tail(self) -> bytes:
        """The bytes the check itself adds at the end of every block (a salt), not read."""
        return self._tail

    def size(self, slot: int) -> int:
        """The size of block ``slot``, as the read expects it (its tail included)."""
        return self._slots[slot].size

    def feed(self, slot: int, offset: int, pieces: Sequence[Buffer]) -> None:
        """The bytes ``pieces`` (back to back) were read from ``offset`` of block ``slot``."""
        if not self.hashing:
            return
        s = self._slots[slot]
        with s.lock:
            if offset != s.done:
                heapq.heappush(s.waiting, (offset, next(self._seq), pieces))
                return
            self._hash(s, pieces)
            while s.waiting and s.waiting[0][0] <= s.done:
                off, _, more = heapq.heappop(s.waiting)
                if off != s.done:  # overlapping reads: not how a restore reads
                    s.failed = s.failed or f"bytes {off}.. read twice"
                    continue
                self._hash(s, more)

    @staticmethod
    def _hash(s: _Slot, pieces: Sequence[Buffer]) -> None:
        for p in pieces:
            s.hasher.update(p)
            s.done += len(p)

    def settle(self, slot: int) -> bool:
        """Whether block ``slot``, read whole, hashes to its name (an unverified read: whether
        no reader failed it). Failed when not, so :meth:`bad` names it; a staged restore
        asks before it copies a block's bytes on."""
        s = self._slots[slot]
        with s.lock:
            if s.failed:
                return False
            if not self.hashing or s.settled:
                return True
            why = self._verdict(s)
            if why:
                s.failed = why
                return False
            s.settled = True
            return True

    def _verdict(self, s: _Slot) -> str:
        """What is wrong with slot ``s``'s bytes ('' when they hash to its name)."""
        if self._tail and s.done + len(self._tail) == s.size and not s.waiting:
            self._hash(s, [self._tail])
        if s.done != s.size or s.waiting:
            return f"{s.done} of {s.size} bytes read"
        got = s.hasher.digest()
        return f"bytes hashing to {got.hex()}" if got != s.digest else ""

    def fail(self, slot: int, why: str) -> None:
        """A reader found the block unusable (a short read, say)."""
        s = self._slots[slot]
        with s.lock:
            s.failed = s.failed or why

    def bad(self) -> dict[bytes, str]:
        """The blocks whose bytes did not hash to their name, with what was found instead.

        Call once every read is done. A slot whose bytes were not all read is bad too.
        """
        out: dict[bytes, str] = {}
        for s in self._slots:
            if s.failed:
                out.setdefault(s.digest, s.failed)
                continue
            if not self.hashing or s.settled:
                continue
            why = self._verdict(s)
            if why:
                out.setdefault(s.digest, why)
        return out
