"""Read-only views of a root's index for the command line: manifests by id, what each entry
holds alone, block refcounts, the garbage awaiting compaction; and for the bench, the
index reads a lookup makes."""

from __future__ import annotations

from collections.abc import Sequence

from ..catalog.base import open_manifest
from ..catalog.find import find
from ..catalog.keys import TokenKeys
from ..index import IndexRead
from ..schema import Manifest
from .catalog import LocalReader
from .root import Root


class IndexViews:
    """What the command line and the bench read of a root's index (a :class:`Store` part)."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.index = root.index

    def manifests(self, entry_ids: Sequence[str]) -> dict[str, Manifest]:
        """The manifests of these full hex ids, in one read; an id without one is left out."""
        with self.index.read() as txn:
            raws = ((i, self.index.get_manifest(bytes.fromhex(i), txn)) for i in entry_ids)
            return {i: open_manifest(raw, bytes.fromhex(i)) for i, raw in raws
                    if raw is not None}

    def unique_bytes(self, manifests: dict[str, Manifest]) -> dict[str, int]:
        """Per entry id, the bytes of its blocks no other entry references (refcount 1)."""
        out: dict[str, int] = {}
        with self.index.read() as txn:
            for i, m in manifests.items():
                digests = dict.fromkeys(m.all_blocks())
                refs = (self.index.get_ref(d, txn) for d in digests)
                out[i] = sum(r.size for r in refs if r is not None and r.refcount == 1)
        return out

    def unique_bytes_of(self, entry_ids: Sequence[str]) -> dict[str, int]:
        """:meth:`unique_bytes` of these full hex ids, each manifest read, used and let go
        in one read (a caller that lists many entries passes them a batch at a time)."""
        out: dict[str, int] = {}
        with self.index.read() as txn:
            for i in entry_ids:
                d = bytes.fromhex(i)
                raw = self.index.get_manifest(d, txn)
                if raw is None:
                    continue
                m = open_manifest(raw, d)
                refs = (self.index.get_ref(b, txn)
                        for b in dict.fromkeys((*m.token_blocks, *m.state_blocks)))
                out[i] = sum(r.size for r in refs if r is not None and r.refcount == 1)
        return out

    def block_refs(self, digests: Sequence[bytes]) -> dict[bytes, tuple[int, int]]:
        """``(size, refcount)`` of each of these blocks that has a record, in one read."""
        with self.index.read() as txn:
            refs = ((d, self.index.get_ref(d, txn)) for d in digests)
            return {d: (r.size, r.refcount) for d, r in refs if r is not None}

    def unreferenced_blocks(self) -> list[tuple[int, int]]:
        """``(size, zero_since)`` of every block no entry references, awaiting compact."""
        with self.index.read() as txn:
            refs = self.index.iter_refs(txn)
            return [(r.size, r.zero_since) for _, r in refs if r.refcount == 0]

    def lookup_reads(self, tk: TokenKeys) -> list[IndexRead]:
        """The index reads a local lookup of ``tk`` makes: each get and each cursor move."""
        with self.index.traced_read() as txn:
            find(LocalReader(self.index, txn, bisect=self.root.catalog.bisect), tk)
            return txn.reads

    def replay_reads(self, reads: list[IndexRead]) -> int:
        """Those reads as plain gets in one read transaction (a lookup's limit, issue 16);
        returns how many found a value."""
        return self.index.replay_reads(reads)


__all__ = ["IndexViews"]
