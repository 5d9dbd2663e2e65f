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
grace has passed: with a grace ``g``, physical bytes stay within
``max_bytes`` plus the garbage of the last ``g`` seconds, and within
``max_bytes`` exactly with ``g = 0``. A per-namespace budget counts, for each
namespace, the distinct blocks its own entries reference (a block shared by
two namespaces counts in both).

**Order.** Victims are chosen as mlx-lm's ``LRUPromptCache.CacheOrder.pop``
does, so the disk tier behaves like the memory tier in front of it: one
least-recently-used queue per priority (assistant, user, system); take from the
lowest class whose queue is at least as long as the next class's, else move up.
A restore counts as an access (``Store.load`` stamps ``last_access``).

Verification and repair live in :mod:`kvstore.store.verify` and :mod:`kvstore.store.repair`.
"""

from __future__ import annotations

import os
import stat
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..blocks import open_real_dir
from ..codecs.layout import manifest_block_sizes
from ..index import EntryRecord, RefInfo, Totals, now_ms
from ..schema import Manifest, decode_manifest, iter_tensor_specs
from ._crash import crash_point
from .lookup import delete_plan
from .root import Root

DEFAULT_GRACE = 600.0  # seconds
TMP_MAX_AGE = 24 * 3600.0  # a temp file this old is stale even if its pid looks alive
_BATCH = 256  # blocks or entries per write transaction: keeps the writer lock short
_ROUNDS = 8  # budget passes before giving up on a store that concurrent saves keep filling


@dataclass
class CompactReport:
    """What one compact did (or, with ``dry_run``, would do)."""

    evicted: list[str] = field(default_factory=list)  # entry ids, in eviction order
    freed_blocks: int = 0  # block files unlinked with their refs record
    freed_bytes: int = 0
    orphans_removed: int = 0  # block files that had no refs record
    orphan_bytes: int = 0
    tmp_removed: int = 0  # stale files of tmp/
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


def manifest_blocks(m: Manifest) -> dict[bytes, int]:
    """Distinct block digests of a manifest with their expected sizes.

    Raises ManifestError-like ``ValueError`` when the digest lists and the
    tensor specs disagree.
    """
    specs = iter_tensor_specs(m.layers) + [t for a in m.attachments for t in a.tensors]
    tok, state = manifest_block_sizes(
        specs, m.n_tokens, m.block_tokens, m.state_bytes, m.state_block_bytes
    )
    if len(tok) != len(m.token_blocks) or len(state) != len(m.state_blocks):
        raise ValueError(
            f"manifest lists {len(m.token_blocks)}+{len(m.state_blocks)} blocks, "
            f"its tensors need {len(tok)}+{len(state)}"
        )
    out: dict[bytes, int] = {}
    for d, size in zip((*m.token_blocks, *m.state_blocks), (*tok, *state), strict=True):
        if out.setdefault(bytes(d), size) != size:
            raise ValueError(f"block {bytes(d).hex()} listed with two sizes")
    return out


def _cutoff_ms(grace: float) -> int:
    return now_ms() - int(grace * 1000)


def _batches(items: list[Any], n: int = _BATCH) -> Iterator[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EvictionOrder:
    """mlx-lm's ``CacheOrder``: per-priority LRU queues and its balance rule."""

    def __init__(self, rows: Iterable[tuple[bytes, EntryRecord]]) -> None:
        by_class: dict[int, list[tuple[int, bytes]]] = {0: [], 1: [], 2: []}
        for d, rec in rows:
            by_class[min(max(rec.priority, 0), 2)].append((rec.last_access, d))
        self._lrus = [deque(d for _, d in sorted(by_class[p])) for p in (0, 1, 2)]

    def pop(self, skip: set[bytes] | None = None) -> bytes | None:
        """The next victim, or None when every queue is empty."""
        while True:
            d = self._pop()
            if d is None or skip is None or d not in skip:
                return d

    def _pop(self) -> bytes | None:
        lrus = self._lrus
        for i in range(len(lrus) - 1):
            if lrus[i] and len(lrus[i]) >= len(lrus[i + 1]):
                return lrus[i].popleft()
        for q in reversed(lrus):  # only the last is non-empty by now, if any
            if q:
                return q.popleft()
        return None


# --- the budget ------------------------------------------------------------------------


@dataclass
class _Snapshot:
    entries: dict[bytes, EntryRecord]
    refs: dict[bytes, RefInfo]
    totals: Totals


def _snapshot(root: Root) -> _Snapshot:
    with root.index.read() as txn:
        return _Snapshot(
            entries=dict(root.index.iter_entries(txn)),
            refs=dict(root.index.iter_refs(txn)),
            totals=root.index.totals(txn),
        )


def _blocks_of(root: Root, digest: bytes) -> list[bytes]:
    with root.index.read() as txn:
        raw = root.index.get_manifest(digest, txn)
    if raw is None:
        return []
    m = decode_manifest(raw)
    return list(dict.fromkeys(bytes(d) for d in (*m.token_blocks, *m.state_blocks)))


def plan_evictions(
    root: Root, max_bytes: int | None, namespace_max_bytes: int | None
) -> tuple[list[bytes], int]:
    """Victims (in order) that bring live bytes within the budgets; and live bytes after."""
    victims, live, _ = _plan(root, max_bytes, namespace_max_bytes)
    return victims, live


def _plan(
    root: Root, max_bytes: int | None, namespace_max_bytes: int | None
) -> tuple[list[bytes], int, dict[bytes, int]]:
    """`plan_evictions`, and the blocks (with their sizes) the victims leave unreferenced."""
    snap = _snapshot(root)
    counts = {d: r.refcount for d, r in snap.refs.items()}
    sizes = {d: r.size for d, r in snap.refs.items()}
    live = sum(sizes[d] for d, c in counts.items() if c > 0)
    victims: list[bytes] = []
    chosen: set[bytes] = set()
    zeroed: dict[bytes, int] = {}
    blocks_cache: dict[bytes, list[bytes]] = {}

    def blocks(d: bytes) -> list[bytes]:
        if d not in blocks_cache:
            blocks_cache[d] = _blocks_of(root, d)
        return blocks_cache[d]

    def evict(d: bytes) -> None:
        nonlocal live
        victims.append(d)
        chosen.add(d)
        for b in blocks(d):
            if counts.get(b, 0) > 0:
                counts[b] -= 1
                if counts[b] == 0:
                    live -= sizes[b]
                    zeroed[b] = sizes[b]

    if namespace_max_bytes is not None:
        by_ns: dict[str, list[tuple[bytes, EntryRecord]]] = {}
        for d, rec in snap.entries.items():
            by_ns.setdefault(rec.namespace, []).append((d, rec))
        for rows in by_ns.values():
            ns_count: dict[bytes, int] = {}
            for d, _ in rows:
                for b in blocks(d):
                    ns_count[b] = ns_count.get(b, 0) + 1
            ns_bytes = sum(sizes.get(b, 0) for b in ns_count)
            order = EvictionOrder(rows)
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
        order = EvictionOrder(snap.entries.items())
        while live > max_bytes:
            v = order.pop(chosen)
            if v is None:
                break
            evict(v)
    return victims, live, zeroed


def _evict(root: Root, victims: list[bytes], grace: float, report: CompactReport) -> None:
    """Remove the victims in short transactions; unlink what they zero if the grace allows."""
    idx = root.index
    for batch in _batches(victims, 64):
        zeroed: list[bytes] = []
        with idx.write() as txn:
            for d in batch:
                raw = idx.get_manifest(d, txn)
                if raw is None:
                    continue  # deleted meanwhile by another process
                zeroed += idx.remove_entry(txn, d, delete_plan(decode_manifest(raw), d))
                report.evicted.append(d.hex())
            crash_point("delete_before_commit")
        # Unlink in a transaction of its own: were it the eviction's, a crash after
        # the unlink would abort the eviction and leave live manifests without files.
        # The cutoff is taken after remove_entry stamped zero_since: grace 0 frees now.
        if zeroed:
            with idx.write() as txn:
                _unlink_zero(root, txn, zeroed, _cutoff_ms(grace), report)


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


def enforce_budget(root: Root, max_bytes: int, *, grace: float) -> CompactReport | None:
    """Evict until live bytes are within ``max_bytes``; None when already within.

    Cheap when within budget (one read of the totals); called after each save
    of a store opened with ``max_bytes``.
    """
    t = root.index.totals()
    if t.live_bytes <= max_bytes and t.physical_bytes <= max_bytes:
        return None
    report = CompactReport(physical_before=t.physical_bytes)
    cutoff = _cutoff_ms(grace)
    _sweep_zero_refs(root, cutoff, report)
    _apply_budget(root, max_bytes, None, grace, report)
    after = root.index.totals()
    report.physical_after, report.live_after = after.physical_bytes, after.live_bytes
    return report


def _apply_budget(
    root: Root,
    max_bytes: int | None,
    namespace_max_bytes: int | None,
    grace: float,
    report: CompactReport,
) -> None:
    for _ in range(_ROUNDS):
        victims, _ = plan_evictions(root, max_bytes, namespace_max_bytes)
        if not victims:
            return
        _evict(root, victims, grace, report)


# --- sweeping ------------------------------------------------------------------------------


def _sweep_zero_refs(root: Root, cutoff: int, report: CompactReport, dry: bool = False) -> None:
    with root.index.read() as txn:
        due = [
            (d, r)
            for d, r in root.index.iter_refs(txn)
            if r.refcount == 0 and r.zero_since <= cutoff
        ]
    if dry:
        report.freed_blocks += len(due)
        report.freed_bytes += sum(r.size for _, r in due)
        return
    for batch in _batches([d for d, _ in due]):
        with root.index.write() as txn:
            _unlink_zero(root, txn, batch, cutoff, report)


def _block_files(root: Root) -> Iterator[tuple[bytes, os.stat_result]]:
    for d in root.blocks:
        try:
            yield d, root.blocks.path(d).stat()
        except FileNotFoundError:
            continue


def _sweep_orphans(root: Root, cutoff: int, report: CompactReport, dry: bool = False) -> None:
    """Unlink block files with no refs record, last touched before ``cutoff``."""
    idx = root.index
    files = [(d, st) for d, st in _block_files(root) if st.st_mtime * 1000 <= cutoff]
    with idx.read() as txn:
        cands = [(d, st) for d, st in files if idx.get_ref(d, txn) is None]
    if dry:
        report.orphans_removed += len(cands)
        report.orphan_bytes += sum(st.st_size for _, st in cands)
        return
    for batch in _batches(cands):
        with idx.write() as txn:
            for d, _ in batch:
                if idx.get_ref(d, txn) is not None:
                    continue  # a save committed it meanwhile
                try:
                    st = root.blocks.path(d).stat()
                except FileNotFoundError:
                    continue
                if st.st_mtime * 1000 > cutoff:
                    continue  # freshened by a save meanwhile
                crash_point("gc_before_unlink")
                if root.blocks.delete(d):
                    report.orphans_removed += 1
                    report.orphan_bytes += st.st_size
                crash_point("gc_after_unlink")


def _sweep_tmp(root: Root, grace: float, report: CompactReport, dry: bool = False) -> None:
    """Unlink temp files older than the grace whose writer is gone.

    A temp file lives from ``write_tmp`` to ``publish``; its name starts with
    the writer's pid, and a file of a live writer is kept (unless absurdly old)
    so that compaction never makes a save fail.
    """
    now = time.time()
    try:  # through a descriptor that refuses a symlink: never a sweep outside the root
        dfd = open_real_dir(root.blocks.tmp_dir)
    except FileNotFoundError:
        return
    try:
        with os.scandir(dfd) as it:
            entries = list(it)
        for e in entries:
            try:
                st = os.stat(e.name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            age = now - st.st_mtime
            if age < grace or not stat.S_ISREG(st.st_mode):
                continue
            head = e.name.split("-", 1)[0]
            if age < TMP_MAX_AGE and head.isdigit() and _pid_alive(int(head)):
                continue
            if dry:
                report.tmp_removed += 1
                continue
            try:
                os.unlink(e.name, dir_fd=dfd)
                report.tmp_removed += 1
            except FileNotFoundError:
                pass
    finally:
        os.close(dfd)


def compact(
    root: Root,
    *,
    max_bytes: int | None = None,
    namespace_max_bytes: int | None = None,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = False,
) -> CompactReport:
    """Evict above the budgets, then delete expired garbage: zero-ref blocks, orphans, temps.

    ``grace`` (seconds) protects zero-refcount blocks, orphan block files and
    temp files younger than it. ``namespace_max_bytes`` applies to each
    namespace separately. With ``dry_run`` nothing is written; the report says
    what would go (the evictions' own freed blocks are counted once grace 0
    would unlink them).
    """
    if grace < 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace}")
    for name, v in (("max_bytes", max_bytes), ("namespace_max_bytes", namespace_max_bytes)):
        if v is not None and v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    root.index.reader_check()
    before = root.index.totals()
    report = CompactReport(physical_before=before.physical_bytes, dry_run=dry_run, grace=grace)
    if dry_run:
        victims, live, zeroed = _plan(root, max_bytes, namespace_max_bytes)
        report.evicted = [v.hex() for v in victims]
        _sweep_zero_refs(root, _cutoff_ms(grace), report, dry=True)
        # with grace 0 every zero-ref block goes, the evictions' too: live bytes remain
        report.physical_after = live if grace == 0 else before.physical_bytes - report.freed_bytes
        report.live_after = live
        if grace > 0:  # what the evictions would zero waits for the grace, from now
            _held(root, grace, report, {d: (size, now_ms()) for d, size in zeroed.items()})
        _sweep_orphans(root, _cutoff_ms(grace), report, dry=True)
        _sweep_tmp(root, grace, report, dry=True)
        return report
    if max_bytes is not None or namespace_max_bytes is not None:
        _apply_budget(root, max_bytes, namespace_max_bytes, grace, report)
    _sweep_zero_refs(root, _cutoff_ms(grace), report)
    _sweep_orphans(root, _cutoff_ms(grace), report)
    _sweep_tmp(root, grace, report)
    after = root.index.totals()
    report.physical_after, report.live_after = after.physical_bytes, after.live_bytes
    _held(root, grace, report)
    return report


def _held(
    root: Root,
    grace: float,
    report: CompactReport,
    extra: dict[bytes, tuple[int, int]] | None = None,
) -> None:
    """Fill ``report.held_*``: the zero-ref blocks younger than the grace (and ``extra``,
    digest -> (size, zero since), for a dry run's evictions)."""
    cutoff = _cutoff_ms(grace)
    with root.index.read() as txn:
        held = {
            d: (r.size, r.zero_since)
            for d, r in root.index.iter_refs(txn)
            if r.refcount == 0 and r.zero_since > cutoff
        }
    held.update(extra or {})
    report.held_blocks = len(held)
    report.held_bytes = sum(size for size, _ in held.values())
    grace_ms = int(grace * 1000)
    report.held_until = max((z + grace_ms for _, z in held.values()), default=None)


# --- verify -----------------------------------------------------------------------------------


__all__ = [
    "DEFAULT_GRACE",
    "CompactReport",
    "EvictionOrder",
    "compact",
    "enforce_budget",
    "manifest_blocks",
    "plan_evictions",
]
