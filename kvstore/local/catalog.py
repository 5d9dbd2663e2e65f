"""The local tier's catalog: entries by chain key in the root's LMDB index.

Trimmable entries are listed under every chain key ``c_k`` they reach, with their
next tokens as a sorted value: the entry sharing the longest extension of the query
sits next to the query's own position, one seek away. Non-trimmable entries serve only
their exact length; they are found through the exact keys of each length within the
block where the query's chain ends, and leave a reach marker at every depth, so that
"some entry holds the first ``k`` blocks" is monotone in ``k`` and
:func:`~kvstore.catalog.find.find` bisects over depths. Either way the work is bounded
by the query, never by the number of entries.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._crash import crash_point
from ..blocks import Digest
from ..catalog import keys as P
from ..catalog.base import Catalog, Ensure, open_manifest
from ..catalog.find import DepthReader, Match
from ..catalog.records import Records, records_of, trimmable
from ..errors import KVStoreError, ManifestError
from ..index import DeletePlan, EntryRecord, Index, SavePlan
from ..schema import Manifest

_log = logging.getLogger("kvstore")
SCAN = 8  # prefix values examined on each side of a lookup's probe
REACH_META = b"reach-markers"  # meta key: every non-trimmable entry has its reach markers


def prefix_items(rec: Records) -> list[tuple[bytes, bytes]]:
    """The prefix-db values of an entry.

    Trimmable: its next tokens under every depth. Non-trimmable: its digest under the
    state key of its last depth and under the reach key of every depth.
    """
    keys, digest = rec.chain, rec.digest
    if not rec.trimmable:
        return [(P.state_key(keys[-1]), digest)] + [(P.reach_key(k), digest) for k in keys]
    toks, T = P.tokens_from_le(rec.tokens), rec.block_tokens
    return [
        (key, P.prefix_value(toks[k * T : (k + 1) * T], True, digest)) for k, key in enumerate(keys)
    ]


def entry_record(rec: Records) -> EntryRecord:
    """The index's bookkeeping of an entry, from its records."""
    return EntryRecord(namespace=rec.namespace, n_tokens=rec.n_tokens,
                       logical_bytes=rec.logical_bytes, created_at=rec.created_at,
                       last_access=rec.last_access, hits=rec.hits, priority=rec.priority,
                       pulled_unsigned=rec.pulled_unsigned, pin_ttl=rec.pin_ttl)


def save_plan(rec: Records, ensure: Ensure) -> SavePlan:
    """What the index commits for an entry, in one write transaction."""
    return SavePlan(digest=rec.digest, manifest=rec.manifest, blocks=rec.blocks,
                    prefix_items=prefix_items(rec), exact_key=rec.exact_key,
                    entry=entry_record(rec), ensure_block=lambda d: ensure([d]))


def delete_plan(m: Manifest, raw: bytes, digest: bytes) -> DeletePlan:
    """The blocks, prefix keys and exact key entry ``digest`` (of manifest ``m``, encoded
    ``raw``) holds."""
    rec = records_of(m, raw, digest)
    return DeletePlan(blocks=list(rec.blocks), prefix_items=prefix_items(rec),
                      exact_key=rec.exact_key)


class LocalReader(DepthReader):
    """One lookup's view of the index: a read transaction (or a traced one, for the bench)."""

    def __init__(self, index: Index, txn: Any, *, bisect: bool = True,
                 name: str = "local") -> None:
        self.index = index
        self.txn = txn
        self.bisect = bisect
        self.name = name  # the tier's, as each Match's ``where`` says it

    def reaches(self, k: int, chain_key: bytes) -> bool:
        return (self.index.has_prefix(chain_key, self.txn)
                or self.index.has_prefix(P.reach_key(chain_key), self.txn))

    def manifest(self, digest: bytes) -> Manifest | None:
        raw = self.index.get_manifest(digest, self.txn)
        return None if raw is None else open_manifest(raw, digest)

    def neighbors(self, key: bytes, probe: bytes, n: int) -> tuple[list[bytes], list[bytes]]:
        """The values listed under prefix key ``key`` nearest ``probe``: up to ``n`` before
        it and ``n`` from it on (what a parting reads of the entries sharing a depth)."""
        return self.index.neighbors(key, probe, n, self.txn)

    def exact(self, exact_key: bytes) -> tuple[bytes, int] | None:
        """The entry whose tokens are exactly a query's (``exact_key``) and its logical
        bytes; None when there is none or its record is gone."""
        digest = self.index.find_exact(exact_key, self.txn)
        rec = self.index.get_entry(digest, self.txn) if digest is not None else None
        return None if digest is None or rec is None else (digest, rec.logical_bytes)

    def _judged(self, digest: bytes) -> Manifest | None:
        """An entry's manifest for judging a match; None when it is gone or fails
        validation (a lying manifest is no match: ``verify`` reports it, and a lookup, a
        restore or a save that meets it goes on as if it were not there)."""
        try:
            return self.manifest(digest)
        except ManifestError:
            _log.warning("kvstore: entry %s has an invalid manifest; passed over", digest.hex())
            return None

    def best_at(self, tk: P.TokenKeys, k: int) -> Match | None:
        key = tk.chain[k]
        best, crowded = None, False
        if self.index.has_prefix(key, self.txn):
            best, crowded = self._best_trimmable(tk, k)
        if crowded or self.index.has_prefix(P.state_key(key), self.txn):
            best = self._best_exact(tk, k, best)
        return best

    def _best_trimmable(self, tk: P.TokenKeys, k: int) -> tuple[Match | None, bool]:
        """The trimmable entry under ``c_k`` sharing the longest extension of the query among
        its sorted neighbours, and whether they were crowded.

        Values hold an entry's next tokens in the order-preserving encoding (big-endian
        ``t+1``): compared as bytes with the query's own, encoded alike. Crowded: the
        farthest neighbour on a side still holds the query's first ``TAIL`` tokens past
        the block, so more entries may tie there than the window saw (their values
        cannot tell them apart). The caller then probes the exact keys of the block,
        which find any entry that is exactly a prefix of the query, however many tie.
        """
        T, n_q = tk.block_tokens, len(tk)
        base = k * T
        cap = min(T, P.TAIL)
        q_len = min(T, n_q - base)  # the query's tokens past the block boundary
        probe = P.encode_tail(tk.tokens[base : base + cap])
        before, after = self.index.neighbors(tk.chain[k], probe, SCAN, self.txn)
        crowded = q_len > cap and any(
            len(side) == SCAN and side[-1][:-37] == probe for side in (before, after)
        )
        best: Match | None = None
        for v in after + before:
            etail, digest = v[:-37], v[-32:]
            lcp = P.common_tokens(etail, probe)
            n_entry = base + len(etail) // 4
            if len(etail) == 4 * cap:  # the entry goes on past what the value holds
                if lcp == cap:  # and so may the match: compare the entry's own tokens
                    m = self._judged(digest)
                    if m is None:
                        continue
                    lcp = P.common_tokens(m.tokens[4 * base : 4 * (base + T)],
                                          tk.le[4 * base : 4 * (base + T)])
                    n_entry = m.n_tokens
                else:
                    rec = self.index.get_entry(digest, self.txn)
                    if rec is None:
                        continue
                    n_entry = rec.n_tokens
            length = min(base + lcp, n_q, n_entry)
            if length <= 0:
                continue
            exact = n_entry == n_q == length
            if best is None or (length, exact) > (best.length, best.exact):
                best = Match(Digest(digest), length, exact, True, n_entry, where=self.name)
        return best, crowded

    def _best_exact(self, tk: P.TokenKeys, k: int, best: Match | None) -> Match | None:
        """The longest entry ending in block ``k`` whose tokens are exactly a prefix of the
        query (``best``, when none is longer)."""
        T, n_q = tk.block_tokens, len(tk)
        floor = max(k * T - 1, best.length if best is not None else 0)  # exclusive
        if best is not None and not best.exact and best.length == n_q:
            floor -= 1  # an exact entry of the same length is better
        for length in range(min(n_q, (k + 1) * T - 1), floor, -1):
            digest = self.index.find_exact(tk.exact_key(length), self.txn)
            if digest is None:
                continue
            m = self._judged(digest)
            if m is None:
                continue
            return Match(Digest(digest), length, length == n_q, trimmable(m.layers), length,
                         where=self.name)
        return best


class LocalCatalog(Catalog):
    """The entries of a root, in its LMDB index."""

    name = "local"

    def __init__(self, index: Index, *, bisect: bool = True, name: str = "local") -> None:
        self.index = index
        self.name = name  # another root's below this one is named otherwise (its Tiers')
        self.read_only = index.readonly
        self.bisect = bisect  # lookups bisect the chain (the root has its reach markers)

    @contextmanager
    def reader(self) -> Iterator[LocalReader]:
        with self.index.read() as txn:
            yield LocalReader(self.index, txn, bisect=self.bisect, name=self.name)

    def exact(self, exact_key: bytes) -> bytes | None:
        with self.index.read() as txn:
            return self.index.find_exact(exact_key, txn)

    def pin(self, digest: bytes, pin_ttl: int, stamp: int) -> bool:
        """Give entry ``digest`` a pin of at least ``pin_ttl`` ms and its last access
        ``stamp``, in one write transaction; False when it is gone."""
        with self.index.write() as txn:
            rec = self.index.get_entry(digest, txn)
            if rec is None:
                return False
            rec.pin_ttl = max(rec.pin_ttl, pin_ttl)
            rec.last_access = max(rec.last_access, stamp)
            self.index.put_entry(txn, digest, rec)
        return True

    def manifest_bytes(self, digest: bytes) -> bytes | None:
        with self.index.read() as txn:
            return self.index.get_manifest(digest, txn)

    def where(self, digest: bytes) -> str:
        return f"{self.index.path}: manifest {digest.hex()}"

    def records(self, digest: bytes) -> Records | None:
        with self.index.read() as txn:
            raw = self.index.get_manifest(digest, txn)
            entry = self.index.get_entry(digest, txn)
        if raw is None:
            return None
        m = open_manifest(raw, digest)
        if entry is None:  # a record lost: what the manifest alone says
            return records_of(m, raw, digest, last_access=m.created_at)
        return records_of(m, raw, digest, priority=entry.priority,
                          last_access=entry.last_access, hits=entry.hits,
                          pulled_unsigned=entry.pulled_unsigned, pin_ttl=entry.pin_ttl)

    def __iter__(self) -> Iterator[bytes]:
        with self.index.read() as txn:
            digests = [d for d, _ in self.index.iter_entries(txn)]
        return iter(digests)

    def namespace_names(self) -> set[str]:
        """The encoded namespace of every entry, each once (one read transaction)."""
        with self.index.read() as txn:
            return {rec.namespace for _, rec in self.index.iter_entries(txn)}

    def entry_records(self, after: bytes | None = None,
                      limit: int | None = None) -> list[tuple[bytes, EntryRecord]]:
        """Up to ``limit`` (digest, entry record) pairs in digest order, past ``after``
        when given, read in one read transaction (none held open after it)."""
        with self.index.read() as txn:
            return list(itertools.islice(self.index.iter_entries(txn, after), limit))

    def _commit(self, rec: Records, ensure: Ensure) -> bool:
        return self.index.commit_save(save_plan(rec, ensure))

    def _remove(self, digest: bytes) -> bool:
        with self.index.write() as txn:
            gone = self.remove_in(txn, digest)
            crash_point("delete_before_commit")
        return gone is not None

    def remove_in(self, txn: Any, digest: bytes) -> list[bytes] | None:
        """Inside the write transaction ``txn``: remove an entry and its references; the
        blocks it left at refcount zero, or None when it was not there."""
        raw = self.index.get_manifest(digest, txn)
        if raw is None:
            return None
        m = open_manifest(raw, digest)
        return self.index.remove_entry(txn, digest, delete_plan(m, raw, digest))

    def add_reach_markers(self) -> int:
        """Give every non-trimmable entry its reach markers, once per root; returns how many
        entries.

        Roots written before reach markers existed list a non-trimmable entry only
        under its state key. This finds those keys, derives each entry's chain from its
        manifest and adds the markers, then records that the root has them, all in one
        write transaction.
        """
        index = self.index
        done = 0
        with index.write() as txn:
            if index.get_meta(REACH_META, txn) is not None:
                return 0
            digests: dict[bytes, None] = {}
            for key, value in index.iter_prefix(txn):
                if len(key) == 33 and key[-1:] == b"s":  # a state key
                    digests[value] = None
            for digest in digests:
                raw = index.get_manifest(digest, txn)
                if raw is None:
                    continue
                for key in records_of(open_manifest(raw, digest), raw, digest).chain:
                    index.put_prefix(txn, P.reach_key(key), digest)
                done += 1
            index.put_meta(REACH_META, b"1", txn)
        return done

    def migrate(self, *, writable: bool) -> None:
        """Whether lookups may bisect: every non-trimmable entry has its reach markers.

        A root from before reach markers gets them here, once; if it cannot be written,
        its lookups walk every depth instead (slower, same answers).
        """
        if self.index.get_meta(REACH_META) is not None:
            self.bisect = True
            return
        self.bisect = False
        if not writable:
            return
        try:
            n = self.add_reach_markers()
        except KVStoreError as e:
            _log.warning("kvstore: lookups will not bisect: %s", e)
            return
        if n:
            _log.info("kvstore: added reach markers for %d non-trimmable entries", n)
        self.bisect = True


__all__ = ["LocalCatalog", "LocalReader", "delete_plan", "prefix_items", "save_plan"]
