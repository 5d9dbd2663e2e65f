"""Maintenance of a root's entries: listing, resolving, deleting, compacting, verifying
and the totals. Mixed into :class:`~kvstore.store.Store`, which delegates the work to
the modules that own it (gc, verify, entries)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from .._crash import crash_point
from ..index import DeletePlan, Index
from ..schema import Manifest, Namespace, decode_manifest
from .entries import Entry, Stats, entries_of, resolve_id
from .gc import DEFAULT_GRACE, CompactReport, compact
from .lookup import delete_plan
from .root import Root
from .sweep import TempFiles, temp_files
from .verify import Progress, VerifyReport, verify


class Maintenance:
    """Mixed into :class:`~kvstore.store.Store` (whose index and root parts it works on)."""

    index: Index
    parts: Root
    if TYPE_CHECKING:

        def flush_access(self) -> None: ...
        def _check_writable(self, what: str) -> None: ...
        @staticmethod
        def _digest(entry_id: str | bytes) -> bytes: ...

    def resolve(self, entry_id: str) -> str:
        """A full entry id from a unique prefix of at least ``MIN_ID_PREFIX`` (4) hex chars."""
        return resolve_id(entry_id, (e.id for e in self.entries()))

    def delete(self, entry_id: str | bytes) -> bool:
        """Remove an entry and drop its block references; False when it did not exist."""
        self._check_writable("delete an entry")
        digest = self._digest(entry_id)
        with self.index.write() as txn:
            raw = self.index.get_manifest(digest, txn)
            if raw is None:
                return False
            self.index.remove_entry(txn, digest, delete_plan(decode_manifest(raw), digest))
            crash_point("delete_before_commit")
        return True

    def delete_plan(self, m: Manifest, digest: bytes) -> DeletePlan:
        """The blocks, prefix keys and exact key an entry holds."""
        return delete_plan(m, digest)

    def entries(self, *, namespace: Namespace | None = None) -> Iterator[Entry]:
        """Every entry (or those of one namespace)."""
        self.flush_access()
        with self.index.read() as txn:
            rows = list(self.index.iter_entries(txn))
        return entries_of(rows, namespace)

    def compact(
        self,
        *,
        max_bytes: int | None = None,
        namespace_max_bytes: int | None = None,
        grace: float = DEFAULT_GRACE,
        dry_run: bool = False,
        progress: Progress | None = None,
    ) -> CompactReport:
        """Evict above the byte budgets, delete expired garbage (:func:`.gc.compact`);
        ``progress(phase, done, total)`` follows the work."""
        if not dry_run:
            self._check_writable("compact")
        self.flush_access()
        return compact(
            self.parts,
            max_bytes=max_bytes,
            namespace_max_bytes=namespace_max_bytes,
            grace=grace,
            dry_run=dry_run,
            progress=progress,
        )

    def verify(
        self, *, read_data: bool = False, repair: bool = False, dry_run: bool = False,
        progress: Progress | None = None,
    ) -> VerifyReport:
        """Check refcounts, blocks and keys (and, with ``read_data``, every block's
        bytes); ``repair`` fixes what it finds, ``dry_run`` only says how. See
        :func:`kvstore.verify.verify`."""
        if repair:
            self._check_writable("repair")
        self.flush_access()
        return verify(self.parts, read_data=read_data, repair=repair, dry_run=dry_run,
                      progress=progress)

    def temp_files(self) -> TempFiles:
        """What ``tmp/`` holds: writes in progress, and files a writer that is gone left (a
        save killed midway), which the next compact removes whatever its grace."""
        return temp_files(self.parts)

    def stats(self) -> Stats:
        """Entries, blocks, logical vs physical bytes and the dedup ratio.

        The ratio is logical bytes over the bytes of the blocks the entries
        reference (unreferenced blocks waiting for compact are not the entries'),
        1.0 when no entry references any block, as on a fresh root.
        """
        self.flush_access()
        t = self.index.totals()
        ratio = t.logical_bytes / t.live_bytes if t.live_bytes > 0 else 1.0
        return Stats(
            t.entries, t.blocks, t.logical_bytes, t.physical_bytes, ratio, t.lookups, t.hits
        )


__all__ = ["Maintenance"]
