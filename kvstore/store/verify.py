"""Verification of a root: recount references, check every block, repair.

Part of the GC (see :mod:`kvstore.gc`, which re-exports :func:`verify` and
:class:`VerifyReport`): the repair runs in one write transaction, recounting
from the manifests under the writer lock, so it is safe while other processes
save, restore and compact. Moving a corrupt block to ``quarantine/`` happens
inside that transaction; a repair killed before its commit leaves the block
missing (never wrong bytes), and the next repair drops its entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from ..errors import KVStoreError
from ..index import EntryRecord, RefInfo, now_ms
from ..schema import Manifest, decode_manifest
from . import keys as P
from .gc import _block_files, manifest_blocks

if TYPE_CHECKING:
    from .store import Store


@dataclass
class VerifyReport:
    """What verify found (and, with ``repair``, fixed).

    ``sound`` is True only when nothing is wrong: every referenced block is on
    disk with the right size (and, with ``read_data``, the right digest), the
    stored refcounts equal the counts recomputed from the manifests, every key
    points at a manifest, and the totals add up. ``orphans`` (block files with
    no refs record) and ``dangling_refs`` (zero-refcount records whose file is
    gone) are leftovers of a crash or of a save still in flight: they can never
    serve wrong bytes, so they do not make a store unsound; ``clean`` also
    requires there be none.
    """

    entries: int = 0
    blocks: int = 0
    bytes_hashed: int = 0
    missing_blocks: list[str] = field(default_factory=list)
    corrupt_blocks: list[str] = field(default_factory=list)
    bad_manifests: list[str] = field(default_factory=list)
    # (block, stored, counted); stored is -1 when the refs record is missing
    refcount_drift: list[tuple[str, int, int]] = field(default_factory=list)
    size_drift: list[tuple[str, int, int]] = field(default_factory=list)  # block, stored, expected
    dangling_keys: int = 0  # prefix/exact keys and entry records naming no manifest
    missing_entry_records: list[str] = field(default_factory=list)
    totals_drift: list[tuple[str, int, int]] = field(default_factory=list)  # field, stored, counted
    orphans: list[str] = field(default_factory=list)
    dangling_refs: list[str] = field(default_factory=list)
    repaired: bool = False
    quarantined: list[str] = field(default_factory=list)
    dropped_entries: list[str] = field(default_factory=list)
    orphans_removed: int = 0

    @property
    def sound(self) -> bool:
        return not (
            self.missing_blocks
            or self.corrupt_blocks
            or self.bad_manifests
            or self.refcount_drift
            or self.size_drift
            or self.dangling_keys
            or self.missing_entry_records
            or self.totals_drift
        )

    @property
    def clean(self) -> bool:
        return self.sound and not self.orphans and not self.dangling_refs


@dataclass
class _Scan:
    manifests: set[bytes] = field(default_factory=set)
    needs: dict[bytes, set[bytes]] = field(default_factory=dict)  # manifest -> its blocks
    counted: dict[bytes, int] = field(default_factory=dict)
    expected: dict[bytes, int] = field(default_factory=dict)
    refs: dict[bytes, RefInfo] = field(default_factory=dict)
    bad: set[bytes] = field(default_factory=set)  # undecodable manifests


def _scan(store: Store, txn: Any, report: VerifyReport) -> _Scan:
    idx = store.index
    s = _Scan()
    for k, v in txn.cursor(db=idx.db("manifests")):
        d = bytes(k)
        s.manifests.add(d)
        try:
            blocks = manifest_blocks(decode_manifest(bytes(v)))
        except (KVStoreError, ValueError):
            s.bad.add(d)
            report.bad_manifests.append(d.hex())
            continue
        s.needs[d] = set(blocks)
        for b, size in blocks.items():
            s.counted[b] = s.counted.get(b, 0) + 1
            if s.expected.setdefault(b, size) != size:
                report.bad_manifests.append(d.hex())
    s.refs = dict(idx.iter_refs(txn))
    entries = dict(idx.iter_entries(txn))
    report.entries = len(entries)
    report.blocks = len(s.refs)
    for d in s.manifests - entries.keys():
        report.missing_entry_records.append(d.hex())
    report.dangling_keys += len(entries.keys() - s.manifests)
    for _, v in txn.cursor(db=idx.db("prefix")):
        if P.split_value(bytes(v))[2] not in s.manifests:
            report.dangling_keys += 1
    for _, v in txn.cursor(db=idx.db("exact")):
        if bytes(v) not in s.manifests:
            report.dangling_keys += 1
    for b, n in s.counted.items():
        ref = s.refs.get(b)
        if ref is None or ref.refcount != n:
            report.refcount_drift.append((b.hex(), ref.refcount if ref else -1, n))
        elif ref.size != s.expected[b]:
            report.size_drift.append((b.hex(), ref.size, s.expected[b]))
    for b, ref in s.refs.items():
        if b not in s.counted and ref.refcount != 0:
            report.refcount_drift.append((b.hex(), ref.refcount, 0))
    t = idx.totals(txn)
    counted_totals = {
        "entries": len(entries),
        "logical_bytes": sum(r.logical_bytes for r in entries.values()),
        "blocks": len(s.refs),
        "physical_bytes": sum(r.size for r in s.refs.values()),
        "zero_bytes": sum(r.size for r in s.refs.values() if r.refcount == 0),
    }
    for name, n in counted_totals.items():
        if getattr(t, name) != n:
            report.totals_drift.append((name, getattr(t, name), n))
    return s


def _check_file(store: Store, d: bytes, size: int, read_data: bool) -> tuple[str, int]:
    """('ok' | 'missing' | 'corrupt', bytes hashed) for one block file."""
    got = store.blocks.size(d)
    if got is None:
        return "missing", 0
    if got != size:
        return "corrupt", 0
    if read_data:
        try:
            ok = store.blocks.hash_file(d) == d
        except FileNotFoundError:
            return "missing", 0
        return ("ok" if ok else "corrupt"), got
    return "ok", 0


def verify(store: Store, *, read_data: bool = False, repair: bool = False) -> VerifyReport:
    """Check the index against the manifests and the block files; optionally repair.

    Repair quarantines corrupt blocks, drops the entries that need a missing or
    corrupt block (with their prefix keys), rebuilds refcounts and totals from
    the surviving manifests, removes dangling keys, dangling zero records and
    orphan block files, all in one write transaction.
    """
    report = VerifyReport()
    with store.index.read() as txn:
        s = _scan(store, txn, report)
    referenced = {b for b, n in s.counted.items() if n > 0}
    bad_blocks: dict[bytes, str] = {}
    for b in sorted(set(s.refs) | referenced):
        size = s.expected.get(b, s.refs[b].size if b in s.refs else 0)
        state, hashed = _check_file(store, b, size, read_data)
        report.bytes_hashed += hashed
        if state == "ok":
            continue
        if b in referenced:
            bad_blocks[b] = state
        elif state == "missing":
            report.dangling_refs.append(b.hex())
        else:
            bad_blocks[b] = state  # garbage, but corrupt: quarantine it too
    if bad_blocks:  # a concurrent evict + GC may have removed some since the snapshot
        with store.index.read() as txn:
            for b in list(bad_blocks):
                ref = store.index.get_ref(b, txn)
                if bad_blocks[b] == "missing" and (ref is None or ref.refcount == 0):
                    del bad_blocks[b]
    report.missing_blocks = sorted(b.hex() for b, st in bad_blocks.items() if st == "missing")
    report.corrupt_blocks = sorted(b.hex() for b, st in bad_blocks.items() if st == "corrupt")
    report.orphans = sorted(d.hex() for d, _ in _block_files(store) if d not in s.refs)
    if repair:
        _repair(store, set(bad_blocks), read_data, report)
    return report


def _repair(store: Store, suspects: set[bytes], read_data: bool, report: VerifyReport) -> None:
    idx = store.index
    with idx.write() as txn:
        scan = _scan(store, txn, VerifyReport())  # current state, under the writer lock
        bad: set[bytes] = set()
        for b in suspects:
            size = scan.expected.get(b, scan.refs[b].size if b in scan.refs else 0)
            state, _ = _check_file(store, b, size, read_data)
            if state == "ok":
                continue
            bad.add(b)
            if state == "corrupt" and store.blocks.quarantine(b) is not None:
                report.quarantined.append(b.hex())
        # drop the entries that need a bad block, and the undecodable manifests
        for d in sorted(scan.manifests):
            if d in scan.bad:
                txn.delete(d, db=idx.db("manifests"))
                txn.delete(d, db=idx.db("entries"))
                report.dropped_entries.append(d.hex())
            elif scan.needs[d] & bad:
                m = decode_manifest(idx.get_manifest(d, txn) or b"")
                idx.remove_entry(txn, d, store.delete_plan(m, d))
                report.dropped_entries.append(d.hex())
        _rebuild(store, txn, bad, report)
    report.repaired = True


def _rebuild(store: Store, txn: Any, bad: set[bytes], report: VerifyReport) -> None:
    """Recount refs from the manifests in ``txn``; fix keys, records and totals."""
    idx = store.index
    manifests: dict[bytes, dict[bytes, int]] = {}
    for k, v in txn.cursor(db=idx.db("manifests")):
        manifests[bytes(k)] = manifest_blocks(decode_manifest(bytes(v)))
    counted: dict[bytes, tuple[int, int]] = {}
    for blocks in manifests.values():
        for b, size in blocks.items():
            n, _ = counted.get(b, (0, size))
            counted[b] = (n + 1, size)
    stamp = now_ms()
    refs_db = idx.db("refs")
    for b, ref in list(idx.iter_refs(txn)):
        if b in bad or (b not in counted and not store.blocks.exists(b)):
            txn.delete(b, db=refs_db)  # quarantined, or a zero record whose file is gone
            continue
        n, size = counted.get(b, (0, ref.size))
        if (n, size) != (ref.refcount, ref.size):
            zero_since = (ref.zero_since or stamp) if n == 0 else 0
            idx.put_ref(txn, b, RefInfo(n, size, zero_since))
    for b, (n, size) in counted.items():
        if idx.get_ref(b, txn) is None:
            idx.put_ref(txn, b, RefInfo(n, size, 0))
    # keys and records that name no manifest
    prefix_db, exact_db = idx.db("prefix"), idx.db("exact")
    stale = [
        (bytes(k), bytes(v))
        for k, v in txn.cursor(db=prefix_db)
        if P.split_value(bytes(v))[2] not in manifests
    ]
    for k, v in stale:
        txn.delete(k, v, db=prefix_db)
    for k in [bytes(k) for k, v in txn.cursor(db=exact_db) if bytes(v) not in manifests]:
        txn.delete(k, db=exact_db)
    entries = dict(idx.iter_entries(txn))
    for d in entries.keys() - manifests.keys():
        txn.delete(d, db=idx.db("entries"))
        del entries[d]
    for d in manifests.keys() - entries.keys():
        entries[d] = _entry_from_manifest(decode_manifest(idx.get_manifest(d, txn) or b""))
        txn.put(d, _entry_enc(entries[d]), db=idx.db("entries"))
    # orphan files: nothing references them; a save in flight rewrites in its commit
    for d, _ in list(_block_files(store)):
        if idx.get_ref(d, txn) is None and store.blocks.delete(d):
            report.orphans_removed += 1
    refs = dict(idx.iter_refs(txn))
    t = idx.totals(txn)
    t.entries = len(entries)
    t.logical_bytes = sum(r.logical_bytes for r in entries.values())
    t.blocks = len(refs)
    t.physical_bytes = sum(r.size for r in refs.values())
    t.zero_bytes = sum(r.size for r in refs.values() if r.refcount == 0)
    idx.put_totals(txn, t)


def _entry_from_manifest(m: Manifest) -> EntryRecord:
    blocks = manifest_blocks(m)
    sizes = [blocks[bytes(d)] for d in (*m.token_blocks, *m.state_blocks)]
    return EntryRecord(
        namespace=msgspec.json.encode(m.namespace).decode(),
        n_tokens=m.n_tokens,
        logical_bytes=sum(sizes),
        created_at=m.created_at,
        last_access=m.created_at,
    )


def _entry_enc(rec: EntryRecord) -> bytes:
    return msgspec.msgpack.encode(rec)


__all__ = ["VerifyReport", "verify"]
