"""Compaction of the remote: evict least-recently-used entries to a byte budget and
delete the blocks no manifest references, under the GC lease.

The order is what makes it safe against a machine that publishes an entry reusing
blocks meanwhile (docs/FORMAT.md, "The remote tier", has the argument): the lease
is taken first; then markers, blocks and manifests are listed, in that order; every
batch of deletes is preceded by a check that the lease is still ours with more than
its margin left; the lease is released last. Evicting an entry deletes its markers
(it stops matching), then its manifest; its blocks are then unreferenced. As the local
root's, it is a plan (:func:`plan_compact`) that does exactly what it says, once, and it
evicts in the root's order (kvstore.catalog.thinning): the checkpoints first (the
intermediate ones by level, then each conversation's deepest), then every other entry as
mlx-lm's ``CacheOrder`` takes them (one least-recently-used queue per priority).

A compactor with the signing key acts on signed manifests only: a refused one (unsigned,
or signed with another key or for another store) is never evicted, its markers and
access times are kept, its bytes count toward no budget, and the blocks it names are
not swept (it may be a keyless machine's entry: nothing is deleted on its word, nor
from under it). It is listed in ``refused``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .._crash import crash_point
from ..blocks.base import BlockStat
from ..catalog.base import Plan, open_manifest
from ..catalog.records import namespace_of
from ..catalog.signing import UnsignedManifestError
from ..catalog.thinning import EvictionOrder, checkpoint_order
from ..errors import KVStoreError
from ..schema import Manifest
from .errors import RemoteLeaseError, RemoteNotFoundError
from .layout import EXACT, MANIFESTS, MARKERS, entry_of_key
from .tier import RemoteTier

DEFAULT_GRACE = 3600.0  # seconds an unreferenced remote block is kept (a pull may be reading it)
BATCH = 1000  # keys per delete request (the S3 maximum)


@dataclass
class RemoteCompactReport:
    """What a remote compaction did (or, with ``dry_run``, would do)."""

    url: str
    dry_run: bool
    entries: int = 0
    evicted: list[str] = field(default_factory=list)
    blocks: int = 0
    blocks_deleted: int = 0
    bytes_deleted: int = 0
    young: int = 0  # unreferenced blocks kept: younger than the grace
    live_bytes: int = 0  # bytes of the blocks the kept entries reference
    markers_deleted: int = 0
    manifests_deleted: int = 0
    access_merged: int = 0
    access_ignored: int = 0  # access records (or objects) that could not be parsed
    bad_manifests: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # manifests not signed with our key

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class RemoteCompactPlan(Plan[RemoteCompactReport]):
    """What one remote compaction will delete, listed under the GC lease (``leased``) or, for
    a dry run, without it. :meth:`report` is the dry run; :meth:`execute` removes exactly
    the planned entries (:meth:`RemoteCatalog.remove_many`) and blocks
    (:meth:`S3BlockStore.delete_many`), checking before each batch that the lease is still
    held, then lets the lease go; what others removed meanwhile is skipped (the report of
    the execution counts what it removed). A plan not executed lets it go with
    :meth:`release`."""

    remote: RemoteTier
    leased: bool
    planned: RemoteCompactReport
    evict: list[bytes]  # entries, in eviction order
    dangling: list[bytes]  # entries that have markers and no manifest
    marks: dict[bytes, list[str]]  # the marker objects listed for each of them
    sweep: dict[bytes, int]  # unreferenced blocks past the grace -> size
    merged: dict[str, int]
    access_keys: list[str]

    def report(self) -> RemoteCompactReport:
        return dataclasses.replace(self.planned, dry_run=True)

    def _execute(self) -> RemoteCompactReport:
        if not self.leased:
            raise RemoteLeaseError("a plan made without the lease cannot be executed",
                                   bucket=self.remote.url.bucket, key=self.remote.lease.key)
        try:
            return _execute(self.remote, self)
        finally:
            self.release()

    def release(self) -> None:
        if self.leased:
            self.remote.lease.release()


def plan_compact(remote: RemoteTier, *, max_bytes: int | None, grace: float,
                 lease: bool = True) -> RemoteCompactPlan:
    """Plan evicting above ``max_bytes`` (None: no budget) and deleting unreferenced blocks
    older than ``grace`` seconds. With ``lease`` (a plan to execute) the lease is taken
    before anything is listed, and held by the plan."""
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if grace < 0:
        raise ValueError(f"grace must be >= 0, got {grace}")
    if lease:
        remote.lease.take()
    try:
        return _plan(remote, max_bytes, grace, lease)
    except BaseException:
        if lease:
            remote.lease.release()
        raise


def compact(
    remote: RemoteTier, *, max_bytes: int | None, grace: float, dry_run: bool
) -> RemoteCompactReport:
    """Plan (:func:`plan_compact`); ``dry_run``: its report (listed without the lease,
    nothing deleted), else what executing it did."""
    plan = plan_compact(remote, max_bytes=max_bytes, grace=grace, lease=not dry_run)
    if dry_run:
        return plan.report()
    crash_point("remote_gc_after_list")
    return plan.execute()


def _plan(remote: RemoteTier, max_bytes: int | None, grace: float,
          leased: bool) -> RemoteCompactPlan:
    p, c = remote.prefix, remote.client
    rep = RemoteCompactReport(str(remote.url), not leased)
    # markers first: each was put after its manifest, so a manifest listed later covers it
    marks: dict[bytes, list[str]] = defaultdict(list)
    for o in [*c.list(p + MARKERS), *c.list(p + EXACT)]:
        d = entry_of_key(o.key)
        if d is not None:
            marks[d].append(o.key)
    blocks: dict[bytes, BlockStat] = dict(remote.blocks.iter_stats())
    listed = {d: o.mtime for o in c.list(p + MANIFESTS) if (d := entry_of_key(o.key))}
    access, access_keys, rep.access_ignored = remote.read_access()

    def load(d: bytes) -> tuple[bytes, tuple[Manifest, int] | None, set[bytes] | None]:
        try:
            return d, remote.catalog.ranked(d), None
        except UnsignedManifestError:
            return d, None, _named_blocks(remote, d)
        except (KVStoreError, msgspec.DecodeError, ValueError):
            return d, None, None

    mans: dict[bytes, Manifest] = {}
    priority: dict[bytes, int] = {}
    pinned: set[bytes] = set()  # blocks refused manifests name: not swept
    refused: set[bytes] = set()
    for d, got, named in remote.map(load, list(listed)):
        if named is not None:
            refused.add(d)
            pinned |= named
        elif got is None:
            if d in listed and not _gone(remote, d):
                rep.bad_manifests.append(d.hex())
        else:
            mans[d], priority[d] = got
    rep.refused = sorted(d.hex() for d in refused)
    refs: dict[bytes, int] = defaultdict(int)
    uses = {d: set(m.block_digests()) for d, m in mans.items()}
    for bs in uses.values():
        for b in bs:
            refs[b] += 1
    size = {b: st.size for b, st in blocks.items()}
    live = sum(size.get(b, 0) for b in refs)
    last = {d: max(listed[d], access.get(d, 0.0)) for d in mans}
    evict: list[bytes] = []
    if max_bytes is not None:
        for d in _order(mans, priority, last):
            if live <= max_bytes:
                break
            evict.append(d)
            for b in uses[d]:
                refs[b] -= 1
                if refs[b] == 0:
                    live -= size.get(b, 0)
    now = time.time()
    sweep: list[bytes] = []
    young = 0
    for b, st in blocks.items():
        if refs.get(b, 0) > 0 or b in pinned:
            continue
        if now - st.mtime >= grace:
            sweep.append(b)
        else:
            young += 1
    gone = set(evict)
    kept = (set(mans) - gone) | refused
    rep.entries, rep.blocks, rep.young, rep.live_bytes = len(mans), len(blocks), young, live
    rep.evicted = [d.hex() for d in evict]
    rep.blocks_deleted = len(sweep)
    rep.bytes_deleted = sum(size[b] for b in sweep)
    bad = {bytes.fromhex(h) for h in rep.bad_manifests}
    dangling = sorted(d for d in marks if d not in listed and d not in bad)
    rep.markers_deleted = sum(len(marks[d]) for d in (*dangling, *evict) if d in marks)
    rep.manifests_deleted = len(evict)
    merged = {d.hex(): int(t * 1000) for d, t in access.items() if d in kept}
    rep.access_merged = len(access_keys)
    return RemoteCompactPlan(remote, leased, rep, evict, dangling,
                             {d: marks[d] for d in (*evict, *dangling) if d in marks},
                             {b: size[b] for b in sweep}, merged, access_keys)


@dataclass(frozen=True)
class _Ranked:
    """What the checkpoints' order reads of a remote entry (catalog.thinning.Ranked)."""

    priority: int
    namespace: str
    n_tokens: int
    last_access: float


def _order(mans: dict[bytes, Manifest], priority: dict[bytes, int],
           last: dict[bytes, float]) -> list[bytes]:
    """The eviction order, the root compaction's: the checkpoints first, thinned
    (:func:`~kvstore.catalog.thinning.checkpoint_order`), then every other entry as
    mlx-lm's ``CacheOrder`` takes them (:class:`~kvstore.catalog.thinning.EvictionOrder`:
    one least-recently-used queue per priority and its balance rule)."""
    rows = [(d, _Ranked(priority[d], namespace_of(m), m.n_tokens, last[d]))
            for d, m in mans.items()]
    return EvictionOrder(rows, checkpoint_order(rows, lambda d: bytes(mans[d].tokens))).drain()


def _named_blocks(remote: RemoteTier, d: bytes) -> set[bytes]:
    """The blocks a refused manifest names (none when it does not decode or is gone)."""
    try:
        raw = remote.catalog.manifest_bytes(d)
        if raw is None:
            return set()
        return set(open_manifest(raw, d, algo=remote.settings.hash).block_digests())
    except (KVStoreError, msgspec.DecodeError, ValueError):
        return set()


def _gone(remote: RemoteTier, d: bytes) -> bool:
    """Whether a manifest that failed to load was deleted meanwhile (not bad)."""
    try:
        return not remote.catalog.has_manifest(d)
    except RemoteNotFoundError:
        return True


def _chunks(entries: Sequence[bytes], marks: dict[bytes, list[str]]) -> list[list[bytes]]:
    """The entries in runs of about ``BATCH`` objects (their listed markers and manifest):
    the lease is checked before each run's deletes."""
    out: list[list[bytes]] = []
    run: list[bytes] = []
    n = 0
    for d in entries:
        k = len(marks.get(d, ())) + 1
        if run and n + k > BATCH:
            out.append(run)
            run, n = [], 0
        run.append(d)
        n += k
    return [*out, run] if run else out


def _execute(remote: RemoteTier, plan: RemoteCompactPlan) -> RemoteCompactReport:
    rep = dataclasses.replace(plan.planned, dry_run=False, evicted=[])
    cat = remote.catalog
    removed: set[bytes] = set()
    for run in _chunks(plan.evict, plan.marks):  # evicted entries stop matching first
        removed.update(cat.remove_many(run, listed=plan.marks, check=remote.lease.check))
        crash_point("remote_gc_after_delete")
    rep.evicted = [d.hex() for d in plan.evict if d in removed]
    rep.manifests_deleted = len(rep.evicted)
    for run in _chunks(plan.dangling, plan.marks):
        cat.remove_many(run, listed=plan.marks, check=remote.lease.check)
    blocks = sorted(plan.sweep)
    deleted: list[bytes] = []
    for i in range(0, len(blocks), BATCH):
        remote.lease.check()
        deleted += remote.blocks.delete_many(blocks[i : i + BATCH])
    rep.blocks_deleted = len(deleted)
    rep.bytes_deleted = sum(plan.sweep[b] for b in deleted)
    if plan.access_keys:
        remote.lease.check()
        cat.replace_access(plan.merged, plan.access_keys)
    return rep
