"""Verification of a root: recount references, check every block, repair.

Without ``read_data`` the blocks are checked for presence, file type and size
only; their contents are not read (as ``restic check`` without
``--read-data``). The repair is a :class:`~kvstore.local.repair.RepairPlan`
(:func:`plan_repair`) read from one snapshot and executed in one write transaction that
re-checks each step and recounts from the manifests under the writer lock, so it is safe
while other processes save, restore and compact; ``dry_run`` reports the plan and
executes nothing.
Moving a corrupt block to ``quarantine/`` happens inside that transaction; a
repair killed before its commit leaves the block missing (never wrong bytes),
and the next repair deals with its entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..catalog.base import open_manifest
from ..codecs.layout import manifest_blocks
from ..errors import KVStoreError
from ..index import RefInfo
from .repair import RepairPlan, RepairReport, plan_for_blocks, value_digest
from .root import Root


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
    # with repair: the plan's report, what it would do (executed unless dry_run)
    plan: RepairReport | None = None

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
        if value_digest(v) not in s.manifests:
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


Progress = Callable[[str, int, int], None]  # (phase, done, total): a caller's progress bar


def verify(
    root: Root, *, read_data: bool = False, repair: bool = False, dry_run: bool = False,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check the index against the manifests and the block files; optionally repair.

    Repair (:func:`plan_repair`, then its execution) quarantines corrupt blocks, cuts back
    or drops the entries that need a missing or corrupt block (see
    :mod:`kvstore.local.repair`), rebuilds refcounts and totals from the surviving
    manifests, removes dangling keys, dangling zero records and orphan block files, all in
    one write transaction. With ``dry_run`` (only with ``repair``) the plan is made and
    nothing is changed. ``progress("blocks", done, total)`` is called as the blocks are
    checked, in bytes.
    """
    if dry_run and not repair:
        raise ValueError("dry_run is a dry run of repair: pass repair=True as well")
    report, plan = _examine(root, read_data, progress, plan=repair)
    report.dry_run = dry_run
    if plan is None:
        return report
    report.plan = plan.report()
    if not dry_run:
        done = plan.execute()
        report.repaired = True
        report.quarantined = sorted(b.hex() for b in done.quarantine)
        report.dropped_entries = [d.hex() for d in (*done.undecodable, *done.drop)]
        report.cut_entries = [(c.entry.hex(), c.to.hex(), c.n_tokens) for c in done.cut]
        report.orphans_removed = len(done.orphans)
    return report


def plan_repair(root: Root, *, read_data: bool = False,
                progress: Progress | None = None) -> RepairPlan:
    """Check the root (as :func:`verify` does) and plan its repair: :meth:`RepairPlan.report`
    says what :meth:`RepairPlan.execute` will do."""
    plan = _examine(root, read_data, progress, plan=True)[1]
    assert plan is not None
    return plan


def _examine(root: Root, read_data: bool, progress: Progress | None, *, plan: bool
             ) -> tuple[VerifyReport, RepairPlan | None]:
    """What verify finds, and with ``plan`` the repair of it."""
    report = VerifyReport(data_read=read_data)
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
        return report, (_plan(root, txn, s, bad_blocks, report) if plan else None)


def _plan(
    root: Root, txn: Any, s: _Scan, bad: dict[bytes, tuple[str, str]], found: VerifyReport
) -> RepairPlan:
    """The repair of what a scan ``s`` (with ``found``, its report) and the block checks saw."""
    corrupt = {b: why for b, (st, why) in bad.items() if st == "corrupt"}
    missing = {b for b, (st, _) in bad.items() if st == "missing"}
    plan = plan_for_blocks(root, txn, corrupt, missing, skip=s.bad | s.lying)
    p = plan.planned
    p.undecodable = sorted(s.bad)
    p.drop = sorted({*p.drop, *s.lying})  # a manifest that misstates a good block
    p.rebuild = {
        "refcounts": len(found.refcount_drift) + len(found.size_drift),
        "dangling_keys": found.dangling_keys,
        "entry_records": len(found.missing_entry_records),
        "totals": len(found.totals_drift),
        "dangling_refs": len(found.dangling_refs),
    }
    p.orphans = sorted(bytes.fromhex(h) for h in found.orphans)
    plan.recount = True
    return plan


__all__ = ["Progress", "VerifyReport", "plan_repair", "verify"]
