"""Maintenance of a root's entries: listing, resolving, deleting, compacting, verifying and
the totals, delegating the work to the modules that own it (gc, verify, entries)."""

from __future__ import annotations

from collections.abc import Iterator

from ..local import Root
from ..local.gc import DEFAULT_GRACE, CompactReport, plan_compact
from ..local.sweep import TempFiles, temp_files
from ..local.verify import Progress, VerifyReport, verify
from ..schema import Namespace
from .access import AccessLog
from .entries import Entry, Stats, entries_of, resolve_id

_BATCH = 2048  # entry records read per read transaction


class Maintenance:
    """The maintenance calls of a root (a :class:`Store` part). Each first writes the
    access stamps still pending, so what it reads (eviction order, hit counts) is current."""

    def __init__(self, root: Root, access: AccessLog) -> None:
        self.root = root
        self.access = access

    def entries(self, namespace: Namespace | None = None) -> Iterator[Entry]:
        """Every entry (or those of one namespace), in id order, read ``_BATCH`` records a
        read transaction: memory bounded whatever the root holds, and no reader held open
        while the caller works (an entry saved or removed meanwhile may or may not show)."""
        self.access.flush()
        return self._entries(namespace)

    def _entries(self, namespace: Namespace | None) -> Iterator[Entry]:
        after: bytes | None = None
        namespaces: dict[str, Namespace] = {}
        while True:
            rows = self.root.catalog.entry_records(after, _BATCH)
            yield from entries_of(rows, namespace, namespaces)
            if len(rows) < _BATCH:
                return
            after = rows[-1][0]

    def resolve(self, entry_id: str) -> str:
        """A full entry id from a unique prefix of at least ``MIN_ID_PREFIX`` (4) hex chars."""
        return resolve_id(entry_id, (e.id for e in self.entries()))

    def delete(self, digest: bytes) -> bool:
        """Remove an entry and drop its block references; False when it did not exist."""
        return self.root.catalog.remove(digest)

    def compact(self, max_bytes: int | None, namespace_max_bytes: int | None,
                grace: float = DEFAULT_GRACE, dry_run: bool = False,
                progress: Progress | None = None, *, now: int | None = None) -> CompactReport:
        """Plan a compaction (:func:`.gc.plan_compact`); its report, or what executing it did
        (``progress(phase, done, total)`` follows the work). ``now`` (ms): the time pins
        are judged by."""
        self.access.flush()
        plan = plan_compact(self.root, max_bytes=max_bytes,
                            namespace_max_bytes=namespace_max_bytes, grace=grace, now=now)
        plan.progress = progress
        return plan.report() if dry_run else plan.execute()

    def verify(self, read_data: bool, repair: bool, dry_run: bool,
               progress: Progress | None = None) -> VerifyReport:
        """Check (and with ``repair`` fix) refcounts, blocks and keys (:func:`.verify.verify`);
        ``progress(phase, done, total)`` follows the work."""
        self.access.flush()
        return verify(self.root, read_data=read_data, repair=repair, dry_run=dry_run,
                      progress=progress)

    def temp_files(self) -> TempFiles:
        """What ``tmp/`` holds: writes in progress, and files a writer that is gone left (a
        save killed midway), which the next compact removes whatever its grace."""
        return temp_files(self.root)

    def stats(self) -> Stats:
        """Entries, blocks, logical vs physical bytes and the dedup ratio.

        The ratio is logical bytes over the bytes of the blocks the entries
        reference (unreferenced blocks waiting for compact are not the entries'),
        1.0 when no entry references any block, as on a fresh root.
        """
        self.access.flush()
        t = self.root.totals()
        ratio = t.logical_bytes / t.live_bytes if t.live_bytes > 0 else 1.0
        return Stats(
            t.entries, t.blocks, t.logical_bytes, t.physical_bytes, ratio, t.lookups, t.hits
        )


__all__ = ["Maintenance"]
