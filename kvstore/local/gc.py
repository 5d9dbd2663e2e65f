"""Garbage collection and the byte budget of a shared root.

Many processes share one root, so every step here is a short LMDB write
transaction that re-checks what it acts on; nothing relies on a snapshot taken
earlier staying true.

**Unlinking.** A block file is unlinked only inside the write transaction that
removes its refs record (or, for an orphan, that sees it has none). LMDB has
one writer at a time, so a save commits either before (its reference is seen
and the block is kept) or after (it finds no record and rewrites the file in
its own transaction, see ``Index.commit_save``). A process killed between the
unlink and the commit leaves a zero-refcount record whose file is gone; saves
treat a zero record like a missing one, compact drops it, verify lists it
under ``dangling_refs``. The grace period is therefore not needed for
correctness; it spares the rewrite of blocks a save is about to reuse, and
gives readers holding an older snapshot time to open their files.

**Budget.** Bytes are counted per block, once, however many entries share it:
``live`` bytes are the blocks some manifest references, ``physical`` bytes add
the zero-refcount blocks still waiting for their grace. Evicting an entry
frees only the blocks whose refcount falls to zero, so the planner simulates
the refcounts and keeps evicting until the *live* bytes are within the
budget. The blocks it zeroes are unlinked in the eviction's own transaction
when the grace allows it (grace 0), otherwise by a later compact once the
grace has passed: with a grace ``g``, a compact leaves physical bytes within
``max_bytes`` plus the garbage of the last ``g`` seconds, and within
``max_bytes`` exactly with ``g = 0``. The budget after a save (:func:`plan_budget`,
``Store.open(max_bytes=...)``) bounds the physical bytes themselves: the garbage still
in its grace is unlinked too, the oldest first, while they would be over it (issue 36).
A per-namespace budget counts, for each namespace, the distinct blocks its own entries
reference (a block shared by two namespaces counts in both).

**Pins.** An entry saved with a pin (a cache breakpoint's, ``EntryRecord.pin_ttl``) is
never a victim while its TTL has not passed since its last use, as long as the pinned
entries' distinct blocks fit in :data:`PIN_SHARE` of the budget, the most recently used
first (:func:`kept_pins`); the others are ordinary entries for that plan. Pins alone can
therefore never hold the root over its budget.

**Order** (:mod:`kvstore.catalog.thinning`, shared with the remote's compaction).
Checkpoints go first, thinned (the intermediate ones by level, then the deepest of each
conversation). Then victims are chosen as mlx-lm's ``LRUPromptCache.CacheOrder.pop``
does, so the disk tier behaves like the memory tier in front of it: one
least-recently-used queue per priority (assistant, user, system); take from the lowest
class whose queue is at least as long as the next class's, else move up. A restore
counts as an access (``Store.load`` stamps ``last_access``). The budget after a save
takes the most recently used entries, up to :data:`YOUNG_SHARE` of the budget, only after
every other (:func:`_young`): what a request has just written (a new conversation's
checkpoints, which the order above puts first) is not its first victim, and concurrent
conversations each keep their latest entries.

Verification and repair live in :mod:`kvstore.local.verify` and
:mod:`kvstore.local.repair`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._crash import crash_point
from ..catalog.base import Plan, open_manifest
from ..catalog.thinning import EvictionOrder, checkpoint_order
from ..index import EntryRecord, RefInfo, Totals, now_ms
from .root import Root
from .sweep import batches, orphan_files, stale_tmp_files, unlink_orphans, unlink_tmp
from .verify import Progress

DEFAULT_GRACE = 600.0  # seconds
#: The share of a budget that pinned entries (cache breakpoints within their TTL) may hold:
#: beyond it the least recently used pins are evicted as ordinary entries.
PIN_SHARE = 0.5
#: The share of a budget that the most recently used entries fill, which the budget after a
#: save evicts only after every other entry (a request's own entries are never its first
#: victims, whatever their priority).
YOUNG_SHARE = 0.25
#: At most this many entries are young (each costs the plan a manifest read).
YOUNG_MAX = 64


@dataclass
class CompactReport:
    """What one compact did (or, with ``dry_run``, would do)."""

    evicted: list[str] = field(default_factory=list)  # entry ids, in eviction order
    freed_blocks: int = 0  # block files unlinked with their refs record
    freed_bytes: int = 0
    orphans_removed: int = 0  # block files that had no refs record
    orphan_bytes: int = 0
    tmp_removed: int = 0  # stale files of tmp/ (a writer that is gone left them, or too old)
    tmp_bytes: int = 0
    physical_before: int = 0
    physical_after: int = 0
    live_after: int = 0
    # Unreferenced blocks the grace keeps after this run (the evictions' own, mostly):
    # a compact after ``held_until`` (ms since the epoch) frees them, ``grace=0`` now.
    held_blocks: int = 0
    held_bytes: int = 0
    held_until: int | None = None
    grace: float = DEFAULT_GRACE
    dry_run: bool = False

    @property
    def evicted_entries(self) -> int:
        return len(self.evicted)


# --- helpers -------------------------------------------------------------------------


_ANY_TIME = 1 << 62  # a cutoff no zero_since passes: every unreferenced block is past it


def _cutoff_ms(grace: float) -> int:
    return now_ms() - int(grace * 1000)


# --- the budget ------------------------------------------------------------------------


@dataclass
class _Snapshot:
    """What a plan reads of the index, in one read transaction ``txn``: the entry records
    (their namespaces shared), the totals, and the refs records of the blocks the plan
    touches as it goes (:meth:`ref`), not every block's: a plan's memory is the entry
    records' and its victims', whatever the number of blocks (issue 29)."""

    root: Root
    txn: Any
    entries: dict[bytes, EntryRecord]
    totals: Totals
    counts: dict[bytes, int] = field(default_factory=dict)  # refcounts, as the plan left them
    sizes: dict[bytes, int] = field(default_factory=dict)

    def ref(self, b: bytes) -> int:
        """Block ``b``'s refcount as the plan has it so far (0 without a record)."""
        c = self.counts.get(b)
        if c is None:
            r = self.root.index.get_ref(b, self.txn)
            c = self.counts[b] = r.refcount if r is not None else 0
            self.sizes[b] = r.size if r is not None else 0
        return c

    def blocks(self, digest: bytes) -> list[bytes]:
        """The blocks an entry's manifest names ([] when it has none)."""
        raw = self.root.index.get_manifest(digest, self.txn)
        return [] if raw is None else open_manifest(raw, digest).block_digests()

    def live_bytes(self) -> int:
        """The bytes of the blocks some entry references, summed over the refs records."""
        return sum(r.size for _, r in self.root.index.iter_refs(self.txn) if r.refcount > 0)


def _snapshot(root: Root, txn: Any) -> _Snapshot:
    names: dict[str, str] = {}
    entries: dict[bytes, EntryRecord] = {}
    for d, rec in root.index.iter_entries(txn):
        rec.namespace = names.setdefault(rec.namespace, rec.namespace)
        entries[d] = rec
    return _Snapshot(root, txn, entries, root.index.totals(txn))


def _order(snap: _Snapshot, rows: list[tuple[bytes, EntryRecord]],
           last: Sequence[bytes] = ()) -> EvictionOrder:
    """The eviction order of ``rows``: checkpoints thinned first (their tokens read from
    their manifests, in the plan's read transaction), then mlx-lm's classes, ``last``
    after them."""

    def tokens_of(digest: bytes) -> bytes | None:
        raw = snap.root.index.get_manifest(digest, snap.txn)
        return None if raw is None else bytes(open_manifest(raw, digest).tokens)

    return EvictionOrder(rows, checkpoint_order(rows, tokens_of), last)


def _fitting(snap: _Snapshot, digests: Iterable[bytes], cap: int | None) -> list[bytes]:
    """The leading ``digests`` whose distinct blocks together hold at most ``cap`` bytes
    (None: all of them): the first that does not fit ends the list."""
    out: list[bytes] = []
    seen: set[bytes] = set()
    total = 0
    for d in digests:
        new = [b for b in dict.fromkeys(snap.blocks(d)) if b not in seen]
        for b in new:
            snap.ref(b)
        add = sum(snap.sizes[b] for b in new)
        if cap is not None and total + add > cap:
            break
        out.append(d)
        seen.update(new)
        total += add
    return out


def kept_pins(snap: _Snapshot, budget: int | None, now: int) -> set[bytes]:
    """The pinned entries (:meth:`EntryRecord.pinned` at ``now``) a plan must not evict: the
    most recently used first, as long as their distinct blocks fit in :data:`PIN_SHARE` of
    ``budget``; the older ones are ordinary entries for this plan (None: no budget, all)."""
    pinned = sorted(((rec.last_access, d) for d, rec in snap.entries.items()
                     if rec.pinned(now)), reverse=True)
    cap = None if budget is None else int(budget * PIN_SHARE)
    return set(_fitting(snap, (d for _, d in pinned), cap))


def _young(snap: _Snapshot, rows: list[tuple[bytes, EntryRecord]], budget: int) -> list[bytes]:
    """The most recently used of ``rows`` (at least one, at most :data:`YOUNG_MAX`) whose
    distinct blocks fit in :data:`YOUNG_SHARE` of ``budget``, least recently used first:
    evicted last. (At most YOUNG_MAX manifests are read, whatever the budget.)"""
    recent = heapq.nlargest(YOUNG_MAX, ((rec.last_access, d) for d, rec in rows))
    young = _fitting(snap, (d for _, d in recent), int(budget * YOUNG_SHARE))
    return (young or [recent[0][1]])[::-1]


def plan_evictions(
    root: Root, max_bytes: int | None, namespace_max_bytes: int | None, *,
    now: int | None = None,
) -> tuple[list[bytes], int]:
    """Victims (in order) that bring live bytes within the budgets; and live bytes after."""
    victims, live, _ = _plan(root, max_bytes, namespace_max_bytes, now=now)
    return victims, live


def _plan(
    root: Root, max_bytes: int | None, namespace_max_bytes: int | None, *,
    now: int | None = None,
) -> tuple[list[bytes], int, dict[bytes, int]]:
    """`plan_evictions`, and the blocks (with their sizes) the victims leave unreferenced.

    One read transaction: the entries, refs and manifests it reads are one snapshot."""
    with root.index.read() as txn:
        return _plan_in(_snapshot(root, txn), max_bytes, namespace_max_bytes,
                        now=now_ms() if now is None else now)


def _plan_in(
    snap: _Snapshot, max_bytes: int | None, namespace_max_bytes: int | None, *,
    now: int, young: bool = False,
) -> tuple[list[bytes], int, dict[bytes, int]]:
    """The victims, live bytes after them and the blocks they zero. Pinned entries within
    their share are never victims (:func:`kept_pins`); with ``young`` (the budget after a
    save) the most recently used entries go last (:func:`_young`)."""
    counts, sizes = snap.counts, snap.sizes
    pins = kept_pins(snap, max_bytes if max_bytes is not None else namespace_max_bytes, now)
    live = snap.live_bytes()
    victims: list[bytes] = []
    chosen: set[bytes] = set()
    zeroed: dict[bytes, int] = {}
    blocks_cache: dict[bytes, list[bytes]] = {}  # the victims' blocks

    def blocks(d: bytes) -> list[bytes]:
        if d not in blocks_cache:
            blocks_cache[d] = snap.blocks(d)
        return blocks_cache[d]

    def evict(d: bytes) -> None:
        nonlocal live
        victims.append(d)
        chosen.add(d)
        for b in blocks(d):
            if snap.ref(b) > 0:
                counts[b] -= 1
                if counts[b] == 0:
                    live -= sizes[b]
                    zeroed[b] = sizes[b]

    if namespace_max_bytes is not None:
        by_ns: dict[str, list[tuple[bytes, EntryRecord]]] = {}
        for d, rec in snap.entries.items():
            if d not in pins:
                by_ns.setdefault(rec.namespace, []).append((d, rec))
        for rows in by_ns.values():
            ns_count: dict[bytes, int] = {}
            for d, _ in rows:
                for b in snap.blocks(d):  # not kept: only the victims' are
                    ns_count[b] = ns_count.get(b, 0) + 1
            for b in ns_count:
                snap.ref(b)
            ns_bytes = sum(sizes.get(b, 0) for b in ns_count)
            order = _order(snap, rows)
            while ns_bytes > namespace_max_bytes:
                v = order.pop(chosen)
                if v is None:
                    break
                evict(v)
                for b in blocks(v):
                    ns_count[b] -= 1
                    if ns_count[b] == 0:
                        ns_bytes -= sizes.get(b, 0)
    if max_bytes is not None and live > max_bytes:
        rows = [(d, rec) for d, rec in snap.entries.items() if d not in pins and d not in chosen]
        order = _order(snap, rows, _young(snap, rows, max_bytes) if young and rows else ())
        while live > max_bytes:
            v = order.pop(chosen)
            if v is None:
                break
            evict(v)
    return victims, live, zeroed


def _evict(root: Root, victims: list[bytes], grace: float, report: CompactReport,
           step: Callable[[int], None] | None = None) -> None:
    """Remove the victims in short transactions; unlink what they zero if the grace allows.
    ``step(n)`` is told of each batch of ``n`` victims done."""
    idx = root.index
    for batch in batches(victims, 64):
        zeroed: list[bytes] = []
        with idx.write() as txn:
            for d in batch:
                gone = root.catalog.remove_in(txn, d)
                if gone is None:
                    continue  # deleted meanwhile by another process
                zeroed += gone
                report.evicted.append(d.hex())
            crash_point("delete_before_commit")
        # Unlink in a transaction of its own: were it the eviction's, a crash after
        # the unlink would abort the eviction and leave live manifests without files.
        # The cutoff is taken after remove_entry stamped zero_since: grace 0 frees now.
        if zeroed:
            with idx.write() as txn:
                _unlink_zero(root, txn, zeroed, _cutoff_ms(grace), report)
        if step is not None:
            step(len(batch))


def _unlink_zero(
    root: Root, txn: Any, digests: Iterable[bytes], cutoff: int, report: CompactReport
) -> None:
    """Inside ``txn``: unlink each block still at refcount zero since before ``cutoff``."""
    idx = root.index
    for d in digests:
        ref = idx.get_ref(d, txn)
        if ref is None or ref.refcount != 0 or ref.zero_since > cutoff:
            continue
        crash_point("gc_before_unlink")
        if root.blocks.delete(d):
            report.freed_blocks += 1
            report.freed_bytes += ref.size
        crash_point("gc_after_unlink")
        idx.drop_ref(txn, d)


# --- the plan --------------------------------------------------------------------------------


@dataclass
class CompactPlan(Plan[CompactReport]):
    """What one compact will do, read from the index (:func:`plan_compact`, :func:`plan_budget`).

    restic's ``PlanPrune`` then ``Execute``: :meth:`report` is the dry run; :meth:`execute`
    does the planned steps and nothing else, once. Other processes keep saving meanwhile,
    so each step acts only on what is still garbage in its own write transaction; saves
    that take the root over its budget again are the next plan's.
    """

    root: Root
    max_bytes: int | None
    namespace_max_bytes: int | None
    grace: float
    cutoff: int  # ms since the epoch: older than this is past the grace
    physical_before: int
    victims: list[bytes]  # entries to evict, in order
    live_after: int
    zeroed: dict[bytes, int]  # blocks the victims leave unreferenced -> size
    zero_refs: list[tuple[bytes, RefInfo]]  # unreferenced blocks past the grace
    orphans: list[tuple[bytes, int]]  # block files no record names, past the grace -> size
    tmp: list[str]  # stale temp files of tmp/
    held: dict[bytes, tuple[int, int]]  # unreferenced blocks the grace keeps: (size, since)
    tmp_bytes: int = 0  # what the stale temp files hold
    #: unreferenced blocks still in their grace that the budget unlinks all the same, oldest
    #: first, because the root's bytes on disk would stay over it (:func:`plan_budget`)
    pressed: list[tuple[bytes, int]] = field(default_factory=list)
    #: told ``(phase, done, total)`` as :meth:`execute` goes ("evict", then "sweep")
    progress: Progress | None = None

    def empty(self) -> bool:
        return not (self.victims or self.zero_refs or self.orphans or self.tmp or self.pressed)

    def report(self) -> CompactReport:
        """What executing the plan would do (the dry run's report)."""
        r = CompactReport(physical_before=self.physical_before, dry_run=True, grace=self.grace)
        r.evicted = [v.hex() for v in self.victims]
        r.freed_blocks = len(self.zero_refs) + len(self.pressed)
        r.freed_bytes = (sum(ref.size for _, ref in self.zero_refs)
                         + sum(size for _, size in self.pressed))
        r.orphans_removed = len(self.orphans)
        r.orphan_bytes = sum(size for _, size in self.orphans)
        r.tmp_removed = len(self.tmp)
        r.tmp_bytes = self.tmp_bytes
        # with grace 0 every zero-ref block goes, the evictions' too: live bytes remain
        r.physical_after = (
            self.live_after if self.grace == 0 else self.physical_before - r.freed_bytes
        )
        r.live_after = self.live_after
        held = dict(self.held)
        if self.grace > 0:  # what the evictions would zero waits for the grace, from now
            stamp = now_ms()
            held.update((d, (size, stamp)) for d, size in self.zeroed.items())
        _fill_held(r, held, self.grace)
        return r

    def _execute(self) -> CompactReport:
        """Evict the victims, then unlink the planned garbage still garbage.

        ``progress("evict"|"sweep", done, total)`` follows the evictions, then the
        garbage (blocks, orphan files, temp files), in items.
        """
        root, progress = self.root, self.progress
        report = CompactReport(physical_before=self.physical_before, grace=self.grace)
        if self.empty():
            report.physical_after, report.live_after = self.physical_before, self.live_after
            _fill_held(report, _held_blocks(root, self.grace), self.grace)
            return report
        done = {"evict": 0, "sweep": 0}
        totals = {"evict": len(self.victims),
                  "sweep": len(self.zero_refs) + len(self.orphans) + len(self.tmp)}

        def step(phase: str) -> Callable[[int], None]:
            def advance(n: int) -> None:
                done[phase] += n
                if progress is not None:
                    progress(phase, done[phase], totals[phase])
            return advance

        if self.victims:
            _evict(root, self.victims, self.grace, report, step("evict"))
        sweep = step("sweep")
        for batch in batches([d for d, _ in self.zero_refs]):
            with root.index.write() as txn:
                _unlink_zero(root, txn, batch, self.cutoff, report)
            sweep(len(batch))
        for batch in batches([d for d, _ in self.pressed]):  # whatever their grace
            with root.index.write() as txn:
                _unlink_zero(root, txn, batch, _ANY_TIME, report)
        report.orphans_removed, report.orphan_bytes = unlink_orphans(
            root, self.orphans, self.cutoff
        )
        sweep(len(self.orphans))
        report.tmp_removed, report.tmp_bytes = unlink_tmp(root, self.tmp)
        sweep(len(self.tmp))
        after = root.index.totals()
        report.physical_after, report.live_after = after.physical_bytes, after.live_bytes
        _fill_held(report, _held_blocks(root, self.grace), self.grace)
        return report


def _check(grace: float, **budgets: int | None) -> None:
    if grace < 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace}")
    for name, v in budgets.items():
        if v is not None and v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")


def plan_compact(
    root: Root,
    *,
    max_bytes: int | None = None,
    namespace_max_bytes: int | None = None,
    grace: float = DEFAULT_GRACE,
    now: int | None = None,
) -> CompactPlan:
    """Plan a compact: the evictions the budgets need, and the garbage past the grace (zero-ref
    blocks, orphan block files, stale temp files). ``now`` (ms since the epoch, default the
    clock's): the time pins are judged by."""
    _check(grace, max_bytes=max_bytes, namespace_max_bytes=namespace_max_bytes)
    root.index.reader_check()
    physical = root.index.totals().physical_bytes
    victims, live, zeroed = _plan(root, max_bytes, namespace_max_bytes, now=now)
    cutoff = _cutoff_ms(grace)
    with root.index.read() as txn:
        zero = [(d, r) for d, r in root.index.iter_refs(txn) if r.refcount == 0]
    orphans = orphan_files(root, cutoff)
    tmp = stale_tmp_files(root, grace)
    return CompactPlan(
        root=root,
        max_bytes=max_bytes,
        namespace_max_bytes=namespace_max_bytes,
        grace=grace,
        cutoff=cutoff,
        physical_before=physical,
        victims=victims,
        live_after=live,
        zeroed=zeroed,
        zero_refs=[(d, r) for d, r in zero if r.zero_since <= cutoff],
        orphans=orphans,
        tmp=[f.name for f in tmp],
        held={d: (r.size, r.zero_since) for d, r in zero if r.zero_since > cutoff},
        tmp_bytes=sum(f.size for f in tmp),
    )


def plan_budget(root: Root, max_bytes: int, *, grace: float,
                now: int | None = None) -> CompactPlan:
    """The plan that brings a root's bytes on disk within ``max_bytes`` after a save.

    The block files the index knows count, the unreferenced ones still in their grace too:
    it evicts until the live bytes fit (the most recently used entries last, pinned ones
    within their share never: :func:`_plan_in`), unlinks the unreferenced blocks past the
    grace, and then, while the bytes on disk would still be over the budget, unlinks those
    still in their grace too, the longest unreferenced first (the evictions' own last): the
    grace gives way to the bound. A reader that found such a block a moment before gets a
    miss for its entry (never wrong data), as under ``grace=0``. No orphan or temp file
    sweep. Cheap when the root is within the budget (one read of the totals: an empty
    plan). ``now`` (ms, default the clock's): the time pins are judged by.
    """
    _check(grace, max_bytes=max_bytes)
    t = root.index.totals()
    cutoff = _cutoff_ms(grace)
    if t.physical_bytes <= max_bytes:  # live bytes are part of them
        return CompactPlan(root, max_bytes, None, grace, cutoff, t.physical_bytes, [],
                           t.live_bytes, {}, [], [], [], {})
    stamp = now_ms() if now is None else now
    with root.index.read() as txn:
        snap = _snapshot(root, txn)
        victims, live, zeroed = _plan_in(snap, max_bytes, None, now=stamp, young=True)
        zero = [(d, r) for d, r in root.index.iter_refs(txn) if r.refcount == 0]
    past = [(d, r) for d, r in zero if r.zero_since <= cutoff]
    held = sorted((r.zero_since, d, r.size) for d, r in zero if r.zero_since > cutoff)
    on_disk = live + sum(size for *_, size in held) + sum(zeroed.values())
    pressed: list[tuple[bytes, int]] = []
    for d, size in [*((d, size) for _, d, size in held), *zeroed.items()]:
        if on_disk <= max_bytes:
            break
        pressed.append((d, size))
        on_disk -= size
    return CompactPlan(root, max_bytes, None, grace, cutoff, t.physical_bytes, victims, live,
                       zeroed, past, [], [], {}, pressed=pressed)


# --- sweeping ------------------------------------------------------------------------------


def _held_blocks(root: Root, grace: float) -> dict[bytes, tuple[int, int]]:
    """The zero-ref blocks younger than the grace: digest -> (size, zero since)."""
    cutoff = _cutoff_ms(grace)
    with root.index.read() as txn:
        return {
            d: (r.size, r.zero_since)
            for d, r in root.index.iter_refs(txn)
            if r.refcount == 0 and r.zero_since > cutoff
        }


def _fill_held(report: CompactReport, held: dict[bytes, tuple[int, int]], grace: float) -> None:
    """``report.held_*``: what the grace keeps, and when the last of it becomes free."""
    report.held_blocks = len(held)
    report.held_bytes = sum(size for size, _ in held.values())
    grace_ms = int(grace * 1000)
    report.held_until = max((z + grace_ms for _, z in held.values()), default=None)


__all__ = [
    "DEFAULT_GRACE",
    "PIN_SHARE",
    "YOUNG_SHARE",
    "CompactPlan",
    "CompactReport",
    "EvictionOrder",
    "kept_pins",
    "plan_budget",
    "plan_compact",
    "plan_evictions",
]
