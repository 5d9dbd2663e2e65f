"""Verification of a root: recount references, check every block, repair.

Without ``read_data`` the blocks are checked for presence, file type and size
only; their contents are not read (as ``restic check`` without
``--read-data``). The repair is a :class:`~kvstore.store.upkeep.repair.RepairPlan` made and
executed in one write transaction, recounting from the manifests under the
writer lock, so it is safe while other processes save, restore and compact;
``dry_run`` makes the same plan in a read transaction and executes nothing.
Moving a corrupt block to ``quarantine/`` happens inside that transaction; a
repair killed before its commit leaves the block missing (never wrong bytes),
and the next repair deals with its entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...catalog import keys as P
from ...catalog.base import open_manifest
from ...catalog.records import records_of
from ...codecs.layout import manifest_blocks
from ...errors import KVStoreError
from ...index import RefInfo, now_ms
from ..local.catalog import entry_record
from ..local.root import Root
from .repair import RepairPlan, plan_for_blocks


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
    data_read: bool = False  # whether block contents were hashed (read_data)
    dry_run: bool = False
    repaired: bool = False
    quarantined: list[str] = field(default_factory=list)
    dropped_entries: list[str] = field(default_factory=list)
    cut_entries: list[tuple[str, str, int]] = field(default_factory=list)  # old, new, tokens
    orphans_removed: int = 0
    # with repair: what it did (or, with dry_run, would do)
    plan: RepairPlan | None = None

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
    disputed: set[bytes] = field(default_factory=set)  # blocks manifests give two sizes
    lying: set[bytes] = field(default_factory=set)  # manifests that misstate a good block


def _scan(root: Root, txn: Any, report: VerifyReport) -> _Scan:
    idx = root.index
    s = _Scan()
    for d, v in idx.iter_manifests(txn):
        s.manifests.add(d)
        try:
            blocks = manifest_blocks(open_manifest(v, d))
        except (KVStoreError, ValueError):
            s.bad.add(d)
            report.bad_manifests.append(d.hex())
            continue
        s.needs[d] = set(blocks)
        for b, size in blocks.items():
            s.counted[b] = s.counted.get(b, 0) + 1
            if s.expected.setdefault(b, size) != size:
                s.disputed.add(b)  # the block's own bytes say which manifest lies
    s.refs = dict(idx.iter_refs(txn))
    entries = dict(idx.iter_entries(txn))
    report.entries = len(entries)
    report.blocks = len(s.refs)
    for d in s.manifests - entries.keys():
        report.missing_entry_records.append(d.hex())
    report.dangling_keys += len(entries.keys() - s.manifests)
    for _, v in idx.iter_prefix(txn):
        if _value_digest(v) not in s.manifests:
            report.dangling_keys += 1
    for _, v in idx.iter_exact(txn):
        if v not in s.manifests:
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


def _lying(root: Root, txn: Any, s: _Scan, truth: dict[bytes, int]) -> set[bytes]:
    """The manifests that give a block whose bytes hash to its name (``truth``: its real
    size) another size: they lie, the block is good (docs/FORMAT.md, "Trust")."""
    out: set[bytes] = set()
    if not truth:
        return out
    for d, needs in s.needs.items():
        if needs.isdisjoint(truth):
            continue
        raw = root.index.get_manifest(d, txn)
        if raw is None:
            continue
        sizes = manifest_blocks(open_manifest(raw, d))
        if any(sizes.get(b, n) != n for b, n in truth.items()):
            out.add(d)
    return out


def _value_digest(v: bytes) -> bytes:
    """The manifest a prefix-db value names: a trimmable entry's value ends in the
    digest; a non-trimmable entry's state and reach keys hold the bare digest."""
    return v if len(v) == 32 else P.split_value(v)[2]


Progress = Callable[[str, int, int], None]  # (phase, done, total): a caller's progress bar


def verify(
    root: Root, *, read_data: bool = False, repair: bool = False, dry_run: bool = False,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check the index against the manifests and the block files; optionally repair.

    Repair quarantines corrupt blocks, cuts back or drops the entries that need a
    missing or corrupt block (see :mod:`kvstore.store.upkeep.repair`), rebuilds refcounts and
    totals from the surviving manifests, removes dangling keys, dangling zero
    records and orphan block files, all in one write transaction. With
    ``dry_run`` (only with ``repair``) the plan is made and nothing is changed.
    ``progress("blocks", done, total)`` is called as the blocks are checked, in bytes.
    """
    if dry_run and not repair:
        raise ValueError("dry_run is a dry run of repair: pass repair=True as well")
    report = VerifyReport(data_read=read_data, dry_run=dry_run)
    with root.index.read() as txn:
        s = _scan(root, txn, report)
    referenced = {b for b, n in s.counted.items() if n > 0}
    bad_blocks: dict[bytes, tuple[str, str]] = {}  # block -> (state, what is wrong)
    todo = sorted(set(s.refs) | referenced)
    sizes = [s.expected.get(b, s.refs[b].size if b in s.refs else 0) for b in todo]
    total, done = sum(sizes), 0
    truth: dict[bytes, int] = {}  # blocks that hash to their name, of a size in dispute
    for b, size in zip(todo, sizes, strict=True):
        state, why, hashed = root.blocks.inspect(b, size, read_data=read_data or
                                                 b in s.disputed)
        report.bytes_hashed += hashed
        done += size
        if progress is not None:
            progress("blocks", done, total)
        if state == "sized" or (state == "ok" and b in s.disputed):
            truth[b] = hashed
            continue
        if state == "ok":
            continue
        if b in referenced or state == "corrupt":  # garbage, but corrupt: quarantine it too
            bad_blocks[b] = (state, why)
        else:
            report.dangling_refs.append(b.hex())
    if bad_blocks:  # a concurrent evict + GC may have removed some since the snapshot
        with root.index.read() as txn:
            for b in list(bad_blocks):
                ref = root.index.get_ref(b, txn)
                if bad_blocks[b][0] == "missing" and (ref is None or ref.refcount == 0):
                    del bad_blocks[b]
    report.missing_blocks = sorted(b.hex() for b, (st, _) in bad_blocks.items() if st == "missing")
    report.corrupt_blocks = sorted(b.hex() for b, (st, _) in bad_blocks.items() if st == "corrupt")
    report.orphans = sorted(d.hex() for d, _ in root.block_files() if d not in s.refs)
    with root.index.read() as txn:
        s.lying = _lying(root, txn, s, truth)
    report.bad_manifests.extend(d.hex() for d in sorted(s.lying))
    if repair and dry_run:
        with root.index.read() as txn:
            report.plan = _plan(root, txn, s, bad_blocks, report)
    elif repair:
        _repair(root, set(bad_blocks), read_data, report)
    return report


def _plan(
    root: Root, txn: Any, s: _Scan, bad: dict[bytes, tuple[str, str]], found: VerifyReport
) -> RepairPlan:
    """The repair of what a scan ``s`` (with ``found``, its report) and the block checks saw."""
    corrupt = {b: why for b, (st, why) in bad.items() if st == "corrupt"}
    missing = {b for b, (st, _) in bad.items() if st == "missing"}
    plan = plan_for_blocks(root, txn, corrupt, missing, skip=s.bad | s.lying)
    plan.undecodable = sorted(s.bad)
    plan.drop = sorted({*plan.drop, *s.lying})  # a manifest that misstates a good block
    plan.rebuild = {
        "refcounts": len(found.refcount_drift) + len(found.size_drift),
        "dangling_keys": found.dangling_keys,
        "entry_records": len(found.missing_entry_records),
        "totals": len(found.totals_drift),
        "dangling_refs": len(found.dangling_refs),
    }
    plan.orphans = sorted(bytes.fromhex(h) for h in found.orphans)
    return plan


class _NothingToDo(Exception):
    """Aborts a repair's write transaction: a sound store is left byte for byte as it was."""


def _repair(root: Root, suspects: set[bytes], read_data: bool, report: VerifyReport) -> None:
    try:
        _repair_in_txn(root, suspects, read_data, report)
    except _NothingToDo:
        pass
    report.repaired = True


def _repair_in_txn(
    root: Root, suspects: set[bytes], read_data: bool, report: VerifyReport
) -> None:
    idx = root.index
    with idx.write() as txn:
        found = VerifyReport()
        scan = _scan(root, txn, found)  # current state, under the writer lock
        referenced = {b for b, n in scan.counted.items() if n > 0}
        bad: dict[bytes, tuple[str, str]] = {}
        truth: dict[bytes, int] = {}
        for b in suspects | scan.disputed:
            size = scan.expected.get(b, scan.refs[b].size if b in scan.refs else 0)
            state, why, hashed = root.blocks.inspect(
                b, size, read_data=read_data or b in scan.disputed)
            if state == "corrupt" or (state == "missing" and b in referenced):
                bad[b] = (state, why)
            elif state == "sized" or (state == "ok" and b in scan.disputed):
                truth[b] = hashed
        scan.lying = _lying(root, txn, scan, truth)
        for b, ref in scan.refs.items():
            if ref.refcount == 0 and b not in referenced and not root.blocks.exists(b):
                found.dangling_refs.append(b.hex())
        found.orphans = sorted(d.hex() for d, _ in root.block_files() if d not in scan.refs)
        plan = _plan(root, txn, scan, bad, found)
        report.plan = plan
        if plan.empty():
            raise _NothingToDo
        moved = plan.execute(root, txn)
        _rebuild(root, txn, set(bad), plan, report)
    report.quarantined = sorted(b.hex() for b in moved)
    report.dropped_entries = [d.hex() for d in (*plan.undecodable, *plan.drop)]
    report.cut_entries = [(c.entry.hex(), c.to.hex(), c.n_tokens) for c in plan.cut]


def _rebuild(
    root: Root, txn: Any, bad: set[bytes], plan: RepairPlan, report: VerifyReport
) -> None:
    """Recount refs from the manifests in ``txn``; fix keys, records and totals."""
    idx = root.index
    manifests: dict[bytes, dict[bytes, int]] = {}
    for d, v in idx.iter_manifests(txn):
        manifests[d] = manifest_blocks(open_manifest(v, d))
    counted: dict[bytes, tuple[int, int]] = {}
    for blocks in manifests.values():
        for b, size in blocks.items():
            n, _ = counted.get(b, (0, size))
            counted[b] = (n + 1, size)
    stamp = now_ms()
    for b, ref in list(idx.iter_refs(txn)):
        if b in bad or (b not in counted and not root.blocks.exists(b)):
            idx.delete_ref(txn, b)  # quarantined, or a zero record whose file is gone
            continue
        n, size = counted.get(b, (0, ref.size))
        if (n, size) != (ref.refcount, ref.size):
            zero_since = (ref.zero_since or stamp) if n == 0 else 0
            idx.put_ref(txn, b, RefInfo(n, size, zero_since))
    for b, (n, size) in counted.items():
        if idx.get_ref(b, txn) is None:
            idx.put_ref(txn, b, RefInfo(n, size, 0))
    # keys and records that name no manifest
    stale = [(k, v) for k, v in idx.iter_prefix(txn) if _value_digest(v) not in manifests]
    for k, v in stale:
        idx.delete_prefix(txn, k, v)
    for k in [k for k, v in idx.iter_exact(txn) if v not in manifests]:
        idx.delete_exact(txn, k)
    entries = dict(idx.iter_entries(txn))
    for d in entries.keys() - manifests.keys():
        idx.delete_entry(txn, d)
        del entries[d]
    for d in manifests.keys() - entries.keys():  # a record lost: the manifest's own
        raw = idx.get_manifest(d, txn) or b""
        m = open_manifest(raw, d)
        entries[d] = entry_record(records_of(m, raw, d, last_access=m.created_at))
        idx.put_entry(txn, d, entries[d])
    # orphan files: nothing references them; a save in flight rewrites in its commit
    for d in plan.orphans:
        if idx.get_ref(d, txn) is None and root.blocks.delete(d):
            report.orphans_removed += 1
    refs = dict(idx.iter_refs(txn))
    t = idx.totals(txn)
    t.entries = len(entries)
    t.logical_bytes = sum(r.logical_bytes for r in entries.values())
    t.blocks = len(refs)
    t.physical_bytes = sum(r.size for r in refs.values())
    t.zero_bytes = sum(r.size for r in refs.values() if r.refcount == 0)
    idx.put_totals(txn, t)


__all__ = ["Progress", "VerifyReport", "verify"]
