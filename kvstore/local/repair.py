"""Repair as a plan, then its execution: what to do about blocks that went bad.

One planner serves ``verify --repair`` (and ``--dry-run``, which prints the
plan a real run would execute, so the two cannot disagree) and a verified read
that finds a block whose bytes do not match its name.

A bad block is moved to ``quarantine/``. Each entry that needs it is cut back
to the blocks before it when it can serve a shorter prefix: a trimmable entry
whose first bad block is token block *k* >= 1 becomes a new, shorter entry of
its first *k* blocks, with its own manifest, refcounts and prefix keys, unless
an entry for that prefix is already stored. Any other entry that needs a bad
block is dropped. The plan (:class:`RepairPlan`) is read from one snapshot of the index;
its execution is one write transaction that re-checks each step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..catalog import keys as P
from ..catalog.base import Plan, open_manifest
from ..catalog.records import cut_manifest, encoded, records_of
from ..codecs.layout import manifest_blocks
from ..errors import KVStoreError
from ..index import RefInfo, SavePlan, now_ms
from ..schema import Manifest
from .catalog import entry_record, save_plan
from .root import Root


class _Blocks(msgspec.Struct):
    """The digest lists of a manifest; decoding only these skips the rest."""

    token_blocks: tuple[bytes, ...] = ()
    state_blocks: tuple[bytes, ...] = ()
    window_blocks: tuple[bytes, ...] = ()


_blocks_dec = msgspec.msgpack.Decoder(_Blocks)


@dataclass(frozen=True)
class Cut:
    """An entry cut back to its intact first blocks: a new manifest replaces it."""

    entry: bytes
    to: bytes
    n_tokens: int
    save: SavePlan = field(repr=False, compare=False)


@dataclass
class RepairReport:
    """What a repair does (its plan's :meth:`~RepairPlan.report`, the dry run) or did (what
    :meth:`~RepairPlan.execute` returns)."""

    quarantine: dict[bytes, str] = field(default_factory=dict)  # block -> what is wrong
    gone: set[bytes] = field(default_factory=set)  # needed blocks with no file at all
    cut: list[Cut] = field(default_factory=list)
    drop: list[bytes] = field(default_factory=list)
    undecodable: list[bytes] = field(default_factory=list)  # manifests removed as they are
    # verify only: recount refs, keys, records and totals from the manifests
    rebuild: dict[str, int] = field(default_factory=dict)
    orphans: list[bytes] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.quarantine or self.cut or self.drop or self.undecodable
                    or any(self.rebuild.values()) or self.orphans)

    def as_dict(self) -> dict[str, Any]:
        return {
            "quarantine": sorted(b.hex() for b in self.quarantine),
            "why": {b.hex(): why for b, why in sorted(self.quarantine.items())},
            "cut": [{"entry": c.entry.hex(), "to": c.to.hex(), "n_tokens": c.n_tokens}
                    for c in self.cut],
            "drop": [d.hex() for d in self.drop],
            "undecodable": [d.hex() for d in self.undecodable],
            **{k: v for k, v in sorted(self.rebuild.items())},
            "orphans": len(self.orphans),
        }

    def summary(self) -> str:
        """One line for the log: the blocks, what they were, and what became of the entries."""
        blocks = ", ".join(f"{b.hex()} ({why})" for b, why in sorted(self.quarantine.items()))
        fate = [f"{c.entry.hex()} cut back to {c.n_tokens} tokens (now {c.to.hex()})"
                for c in self.cut] + [f"{d.hex()} dropped" for d in self.drop]
        return (f"kvstore: corrupt block {blocks} moved to quarantine/; entries that needed it: "
                + (", ".join(fate) if fate else "none"))


@dataclass
class RepairPlan(Plan[RepairReport]):
    """A repair of a root, read from one snapshot of its index (:func:`plan_for_blocks`,
    :func:`kvstore.local.verify.plan_repair`).

    :meth:`report` is the dry run (``verify --repair --dry-run`` prints it); :meth:`execute`
    does the planned steps, once, in one write transaction, each re-checked against what
    others did since the snapshot: an entry removed meanwhile is not dropped or cut again,
    a block rewritten whole meanwhile (its bytes hash to its name, or a missing one is
    there again) is not quarantined and the entries that needed only it are left alone, a
    cut whose prefix another entry now holds drops the entry instead. What it did is its
    report (what others added since is the next plan's).
    """

    root: Root
    planned: RepairReport
    #: entry cut or dropped because of bad blocks -> those blocks (none for a lying entry)
    needs: dict[bytes, set[bytes]] = field(default_factory=dict)
    #: verify's plans: recount refs, keys, records and totals from the manifests, and remove
    #: the orphan block files, under the writer lock
    recount: bool = False

    def empty(self) -> bool:
        return self.planned.empty() and not self.planned.gone

    def report(self) -> RepairReport:
        p = self.planned
        return RepairReport(dict(p.quarantine), set(p.gone), list(p.cut), list(p.drop),
                            list(p.undecodable), dict(p.rebuild), list(p.orphans))

    def _execute(self) -> RepairReport:
        done = RepairReport(rebuild=dict(self.planned.rebuild))
        if self.empty():
            return done  # a sound root is left byte for byte as it was
        with self.root.index.write() as txn:
            self._steps(txn, done)
        return done

    def _steps(self, txn: Any, done: RepairReport) -> None:
        """The plan's steps inside the write transaction ``txn``, into ``done``. Cuts are
        added before the entries they replace are removed, so the blocks they keep never
        pass through refcount zero."""
        root, p = self.root, self.planned
        idx = root.index
        fixed = {b for b in {*p.quarantine, *p.gone} if _whole(root, b)}
        skip = {d for d, bs in self.needs.items() if bs and bs <= fixed}
        removed = {*p.drop, *(c.entry for c in p.cut)}
        dropping: list[bytes] = []
        cutting: list[Cut] = []
        for c in p.cut:
            if c.entry in skip or idx.get_manifest(c.entry, txn) is None:
                continue
            have = idx.find_exact(c.save.exact_key, txn)
            if idx.get_manifest(c.to, txn) is not None or (
                    have is not None and have not in removed
                    and idx.get_manifest(have, txn) is not None):
                dropping.append(c.entry)  # that prefix is stored now: it serves
                continue
            idx.add_entry(txn, c.save)
            cutting.append(c)
        for d in [*p.drop, *dropping, *(c.entry for c in cutting)]:
            if d in skip:
                continue
            if root.catalog.remove_in(txn, d) is not None and d not in {
                    c.entry for c in cutting}:
                done.drop.append(d)
        done.cut = cutting
        for d in p.undecodable:
            if idx.get_manifest(d, txn) is not None:
                idx.delete_records(txn, d)
                done.undecodable.append(d)
        bad = {*p.quarantine, *p.gone} - fixed
        for b in sorted(bad):
            ref = idx.get_ref(b, txn)
            if ref is not None and ref.refcount == 0:
                idx.drop_ref(txn, b)
            if b in p.quarantine:
                if root.blocks.quarantine(b) is not None:
                    done.quarantine[b] = p.quarantine[b]
            else:
                done.gone.add(b)
        if self.recount:
            done.orphans = rebuild(root, txn, bad, p.orphans)


def _whole(root: Root, b: bytes) -> bool:
    """Whether block ``b`` is there and its bytes hash to its name (rewritten meanwhile)."""
    try:
        return root.blocks.hash_stored(b) == b
    except (KVStoreError, OSError):
        return False


def plan_for_blocks(
    root: Root,
    txn: Any,
    bad: dict[bytes, str],
    gone: Iterable[bytes] = (),
    *,
    skip: Iterable[bytes] = (),
) -> RepairPlan:
    """The plan for blocks found bad (``bad``: digest -> what is wrong) or missing (``gone``).

    Finds every manifest that references one of them (decoding only the digest
    lists), and cuts back or drops each. ``skip``: manifests already planned
    for otherwise (undecodable ones).
    """
    plan = RepairPlan(root, RepairReport(quarantine=dict(bad), gone=set(gone) - set(bad)))
    hit = set(bad) | plan.planned.gone
    if not hit:
        return plan
    idx = root.index
    skipped = set(skip)
    users: list[bytes] = []
    for d, v in idx.iter_manifests(txn):
        if d in skipped:
            continue
        try:
            b = _blocks_dec.decode(v)
        except (msgspec.DecodeError, RecursionError):  # layers nested past any cache
            continue  # verify reports it as a bad manifest
        needs = hit.intersection((*b.token_blocks, *b.window_blocks, *b.state_blocks))
        if needs:
            users.append(d)
            plan.needs[d] = needs
    removed = set(users)
    taken: set[bytes] = set()
    for d in sorted(users):
        raw = idx.get_manifest(d, txn)
        try:
            m = open_manifest(raw or b"", d)
            cut = _cut(root, txn, d, m, hit, removed, taken)
        except (KVStoreError, ValueError):
            cut = None
        if cut is None:
            plan.planned.drop.append(d)
        else:
            plan.planned.cut.append(cut)
            taken.add(cut.save.exact_key)
    return plan


def _cut(
    root: Root,
    txn: Any,
    digest: bytes,
    m: Manifest,
    bad: set[bytes],
    removed: set[bytes],
    taken: set[bytes],
) -> Cut | None:
    """The entry ``m`` cut back to the token blocks before its first bad one, if it can be."""
    if bad.intersection((*m.state_blocks, *m.window_blocks)):
        return None
    k = next((i for i, b in enumerate(m.token_blocks) if b in bad), 0)
    short = cut_manifest(m, k)
    if short is None:
        return None
    n = short.n_tokens
    idx = root.index
    raw, to = encoded(short)
    old = idx.get_entry(digest, txn)
    if old is None:
        rec = records_of(short, raw, to, last_access=short.created_at)
    else:  # the cut keeps the entry's own bookkeeping
        rec = records_of(short, raw, to, priority=old.priority, last_access=old.last_access,
                         hits=old.hits, pulled_unsigned=old.pulled_unsigned)
    save = save_plan(rec, lambda ds: None)  # its blocks are the entry's own, referenced
    have = idx.find_exact(save.exact_key, txn)
    if save.exact_key in taken or (
        have is not None and have not in removed and idx.get_manifest(have, txn) is not None
    ):
        return None  # that prefix is stored already: it serves
    if idx.get_manifest(to, txn) is not None:
        return None
    return Cut(digest, to, n, save)


def value_digest(v: bytes) -> bytes:
    """The manifest a prefix-db value names: a trimmable entry's value ends in the
    digest; a non-trimmable entry's state and reach keys hold the bare digest."""
    return v if len(v) == 32 else P.split_value(v)[2]


def rebuild(root: Root, txn: Any, bad: set[bytes], orphans: Iterable[bytes]) -> list[bytes]:
    """Inside ``txn``: recount refs from the manifests; fix keys, records and totals (``bad``:
    the blocks a repair took out of use); remove the ``orphans`` still orphans. Returns the
    orphan files removed."""
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
    stale = [(k, v) for k, v in idx.iter_prefix(txn) if value_digest(v) not in manifests]
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
    removed = [d for d in orphans if idx.get_ref(d, txn) is None and root.blocks.delete(d)]
    refs = dict(idx.iter_refs(txn))
    t = idx.totals(txn)
    t.entries = len(entries)
    t.logical_bytes = sum(r.logical_bytes for r in entries.values())
    t.blocks = len(refs)
    t.physical_bytes = sum(r.size for r in refs.values())
    t.zero_bytes = sum(r.size for r in refs.values() if r.refcount == 0)
    idx.put_totals(txn, t)
    return removed


__all__ = ["Cut", "RepairPlan", "RepairReport", "plan_for_blocks", "rebuild", "value_digest"]
