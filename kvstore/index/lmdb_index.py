"""The LMDB index: manifests, prefix keys, exact keys, refcounts, entries, totals.

It stores manifests as opaque bytes together with the block digests and keys
they reference; it never decodes a manifest itself (callers pass plans).
One environment per process and path, reopened after ``fork``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from ..errors import IndexLockLostError, ReadOnlyStoreError, StoreFullError
from ._env import close_env, lock_identity, open_env
from ._gate import WriteGate, default_timeout
from .errors import IndexStoreError
from .records import (
    DeletePlan,
    EntryRecord,
    RefInfo,
    SavePlan,
    Totals,
    decode_entry,
    decode_totals,
    encode,
    now_ms,
    pack_ref,
    unpack_ref,
)
from .traced import IndexRead, TracedTxn, replay

DEFAULT_MAP_SIZE = 1 << 36  # 64 GiB of address space; the file grows as needed


class Index:
    """The LMDB environment of one root and its named databases."""

    def __init__(
        self,
        path: Path,
        *,
        durable: bool = True,
        map_size: int = DEFAULT_MAP_SIZE,
        readonly: bool = False,
        mode: int = 0o600,
        lock_timeout: float | None = None,
    ) -> None:
        self.path = path
        self.readonly = readonly
        #: How long a write waits for the index's write lock (``$KVSTORE_LOCK_TIMEOUT``)
        self.lock_timeout = default_timeout() if lock_timeout is None else lock_timeout
        self._opts = dict(durable=durable, map_size=map_size, readonly=readonly, mode=mode,
                          timeout=self.lock_timeout)
        self._gate: WriteGate | None = None
        self._lock_id: tuple[int, int] | None = None
        self._pid = -1
        self._env: lmdb.Environment | None = None
        self._dbs: dict[str, Any] = {}
        self._ensure()

    def _ensure(self) -> lmdb.Environment:
        if self._env is not None and self._pid == os.getpid():
            return self._env
        self._env = None  # inherited from the parent, if set: open_env closes it
        try:
            env, self._lock_id, self._dbs, self._gate = open_env(
                self.path, **self._opts  # type: ignore[arg-type]
            )
        except lmdb.Error as e:
            raise IndexStoreError(f"{self.path}: cannot open the index: {e}") from e
        self._env, self._pid = env, os.getpid()
        return env

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            close_env(self.path)
        self._env = None

    # --- transactions ------------------------------------------------------

    def _begin(self, *, write: bool) -> lmdb.Transaction:
        env = self._ensure()
        if write:
            self._check_writable()
        try:
            return env.begin(write=write, buffers=False)
        except lmdb.MapResizedError:
            env.set_mapsize(0)  # another process grew the map: adopt its size
            return env.begin(write=write, buffers=False)

    def _check_writable(self) -> None:
        """Refuse a write on a read-only index, or through a lock file that is gone.

        LMDB's lock file holds the writer mutex and the reader table; a process
        that opened the environment keeps using the file it opened. If it is
        deleted (or replaced) meanwhile, a process that opens the root afterwards
        makes a new one, and the two no longer exclude each other's writes: the
        index would be corrupted. One stat per write transaction detects it.
        """
        if self.readonly:
            raise ReadOnlyStoreError(f"{self.path.parent}: the root is open read-only")
        if self._lock_id is not None and lock_identity(self.path) != self._lock_id:
            raise IndexLockLostError(
                f"{self.path / 'lock.mdb'} was deleted or replaced while this process had "
                "the index open; writing now could corrupt the index, so this process will "
                "not write. Close every store of this root (in every process) and open it "
                "again; never delete index/lock.mdb by hand"
            )

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        try:
            with self._begin(write=False) as txn:
                yield txn
        except lmdb.Error as e:
            raise IndexStoreError(f"{self.path}: {e}") from e

    @contextmanager
    def write(self) -> Iterator[lmdb.Transaction]:
        """One write transaction; aborted (nothing visible) on any exception.

        A full map or a full disk is a :class:`StoreFullError`; LMDB aborts the
        transaction, so the index stays as it was before it. The write lock is waited
        for ``lock_timeout`` seconds at most (:mod:`kvstore.index._gate`), then an
        :class:`IndexBusyError` naming its holder.
        """
        self._ensure()
        self._check_writable()
        gate = self._gate
        if gate is not None:
            gate.acquire(self.lock_timeout)
        try:
            with self._begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError as e:
            raise StoreFullError(
                f"{self.path}: the index map is full; run kvstore compact"
            ) from e
        except lmdb.DiskError as e:
            raise StoreFullError(f"{self.path}: no space left for the index: {e}") from e
        except lmdb.Error as e:
            if "quota" in str(e).lower():
                raise StoreFullError(f"{self.path}: disk quota exceeded: {e}") from e
            raise IndexStoreError(f"{self.path}: {e}") from e
        finally:
            if gate is not None:
                gate.release()

    @contextmanager
    def traced_read(self) -> Iterator[TracedTxn]:
        """A read transaction that records every read made through it (for the bench)."""
        with self.read() as txn:
            yield TracedTxn(txn)

    def replay_reads(self, reads: list[IndexRead]) -> int:
        """A trace's reads as plain gets in one read transaction; how many found a value."""
        with self.read() as txn:
            return replay(txn, reads)

    def reader_check(self) -> int:
        """Clear reader slots left by dead processes; returns how many."""
        return int(self._ensure().reader_check())

    def db(self, name: str) -> Any:
        self._ensure()
        return self._dbs[name]

    # --- meta ----------------------------------------------------------------

    def get_meta(self, key: bytes, txn: lmdb.Transaction | None = None) -> bytes | None:
        if txn is not None:
            v = txn.get(key, db=self.db("meta"))
            return bytes(v) if v is not None else None
        with self.read() as t:
            return self.get_meta(key, t)

    def put_meta(self, key: bytes, value: bytes, txn: lmdb.Transaction | None = None) -> None:
        if txn is not None:
            txn.put(key, value, db=self.db("meta"))
            return
        with self.write() as t:
            self.put_meta(key, value, t)

    def put_meta_if_absent(self, key: bytes, value: bytes) -> bytes:
        """Store ``value`` unless ``key`` is set; returns what is stored, in one transaction.

        Two processes creating one root at once both call this: the writer lock
        orders them, so the second reads the first's value and never overwrites it.
        """
        with self.write() as txn:
            meta = self.db("meta")
            old = txn.get(key, db=meta)
            if old is not None:
                return bytes(old)
            txn.put(key, value, db=meta)
            return value

    def totals(self, txn: lmdb.Transaction | None = None) -> Totals:
        raw = self.get_meta(b"totals", txn)
        return decode_totals(raw) if raw else Totals()

    def _put_totals(self, txn: lmdb.Transaction, t: Totals) -> None:
        txn.put(b"totals", encode(t), db=self.db("meta"))

    # --- reads -----------------------------------------------------------------

    def get_manifest(self, digest: bytes, txn: lmdb.Transaction) -> bytes | None:
        v = txn.get(digest, db=self.db("manifests"))
        return bytes(v) if v is not None else None

    def find_exact(self, key: bytes, txn: lmdb.Transaction) -> bytes | None:
        v = txn.get(key, db=self.db("exact"))
        return bytes(v) if v is not None else None

    def has_prefix(self, key: bytes, txn: lmdb.Transaction) -> bool:
        return txn.get(key, db=self.db("prefix")) is not None

    def neighbors(
        self, key: bytes, probe: bytes, limit: int, txn: lmdb.Transaction
    ) -> tuple[list[bytes], list[bytes]]:
        """Values stored under ``key`` nearest to ``probe`` in sorted order.

        Returns (values before ``probe``, nearest first; values at or after it,
        nearest first), at most ``limit`` each. Cost is one seek plus ``limit``
        steps, whatever the number of values under the key.
        """
        cur = txn.cursor(db=self.db("prefix"))
        if not cur.set_key(key):
            return [], []
        probe = probe or b"\0"  # LMDB refuses an empty value; nothing sorts between them
        after: list[bytes] = []
        before: list[bytes] = []
        if cur.set_range_dup(key, probe):
            after.append(bytes(cur.value()))
            while len(after) < limit and cur.next_dup():
                after.append(bytes(cur.value()))
            cur.set_range_dup(key, probe)
            while len(before) < limit and cur.prev_dup():
                before.append(bytes(cur.value()))
        else:
            cur.set_key(key)
            cur.last_dup()
            before.append(bytes(cur.value()))
            while len(before) < limit and cur.prev_dup():
                before.append(bytes(cur.value()))
        return before, after

    def get_entry(self, digest: bytes, txn: lmdb.Transaction) -> EntryRecord | None:
        v = txn.get(digest, db=self.db("entries"))
        return decode_entry(v) if v is not None else None

    def iter_entries(
        self, txn: lmdb.Transaction, after: bytes | None = None
    ) -> Iterator[tuple[bytes, EntryRecord]]:
        """Every (digest, entry record), in digest order; those past ``after`` when given."""
        cur = txn.cursor(db=self.db("entries"))
        if after is None:
            ok = cur.first()
        else:
            ok = cur.set_range(after)
            if ok and bytes(cur.key()) == after:
                ok = cur.next()
        while ok:
            yield bytes(cur.key()), decode_entry(cur.value())
            ok = cur.next()

    def get_ref(self, digest: bytes, txn: lmdb.Transaction) -> RefInfo | None:
        v = txn.get(digest, db=self.db("refs"))
        return unpack_ref(bytes(v)) if v is not None else None

    def iter_refs(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, RefInfo]]:
        for k, v in txn.cursor(db=self.db("refs")):
            yield bytes(k), unpack_ref(bytes(v))

    def iter_manifests(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, bytes]]:
        """Every (digest, encoded manifest), in digest order."""
        for k, v in txn.cursor(db=self.db("manifests")):
            yield bytes(k), bytes(v)

    def iter_prefix(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, bytes]]:
        """Every (prefix key, value) pair: a key holds one value per entry it leads to."""
        for k, v in txn.cursor(db=self.db("prefix")):
            yield bytes(k), bytes(v)

    def prefix_values(self, key: bytes, txn: lmdb.Transaction) -> list[bytes]:
        """The values stored under one prefix key, in sorted order."""
        cur = txn.cursor(db=self.db("prefix"))
        if not cur.set_key(key):
            return []
        return [bytes(v) for v in cur.iternext_dup()]

    def iter_exact(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, bytes]]:
        """Every (exact key, manifest digest)."""
        for k, v in txn.cursor(db=self.db("exact")):
            yield bytes(k), bytes(v)

    # --- writes ------------------------------------------------------------------

    def record_access(self, hits: dict[bytes, int], *, lookups: int, found: int) -> None:
        """Stamp accessed entries (last access now, hits) and count lookups, in one txn.

        Best effort: on a full map or disk the stamps are dropped; the restores stand.
        """
        if not hits and not lookups:
            return
        stamp = now_ms()
        try:
            with self.write() as txn:
                entries = self.db("entries")
                for digest, n in hits.items():
                    rec = self.get_entry(digest, txn)
                    if rec is None:
                        continue
                    rec.last_access = stamp
                    rec.hits += n
                    txn.put(digest, encode(rec), db=entries)
                if lookups:
                    t = self.totals(txn)
                    t.lookups += lookups
                    t.hits += found
                    self._put_totals(txn, t)
        except StoreFullError:
            return

    def commit_save(self, plan: SavePlan) -> bool:
        """Commit one save in one write transaction; False when the exact entry existed.

        Blocks with no refs record, or with a refcount of zero, are passed to
        ``plan.ensure_block`` first: a GC may have unlinked them since the save
        wrote them (it unlinks only records it removes in the same transaction,
        but a GC killed between its unlink and its commit leaves a zero record
        whose file is gone). Blocks with a positive refcount are never unlinked.
        """
        with self.write() as txn:
            existing = self.find_exact(plan.exact_key, txn)
            if existing is not None and self.get_manifest(existing, txn) is not None:
                return False
            if self.get_manifest(plan.digest, txn) is not None:
                return False  # the very same manifest is already committed
            self.add_entry(txn, plan)
        return True

    def add_entry(self, txn: lmdb.Transaction, plan: SavePlan) -> None:
        """Inside ``txn``: count the plan's block references, put its manifest, keys and record.

        The caller has checked that neither the manifest nor its exact key is there.
        """
        t = self.totals(txn)
        refs = self.db("refs")
        for d, size in plan.blocks.items():
            raw = txn.get(d, db=refs)
            if raw is None:
                plan.ensure_block(d)  # a GC may have removed it: rewrite
                ref = RefInfo(1, size, 0)
                t.blocks += 1
                t.physical_bytes += size
            else:
                old = unpack_ref(bytes(raw))
                if old.refcount == 0:
                    plan.ensure_block(d)
                    t.zero_bytes -= old.size
                ref = RefInfo(old.refcount + 1, old.size, 0)
            txn.put(d, pack_ref(ref), db=refs)
        txn.put(plan.digest, plan.manifest, db=self.db("manifests"))
        prefix = self.db("prefix")
        for k, v in plan.prefix_items:
            txn.put(k, v, db=prefix, dupdata=True)
        txn.put(plan.exact_key, plan.digest, db=self.db("exact"))
        txn.put(plan.digest, encode(plan.entry), db=self.db("entries"))
        t.entries += 1
        t.logical_bytes += plan.entry.logical_bytes
        self._put_totals(txn, t)

    def remove_entry(
        self,
        txn: lmdb.Transaction,
        digest: bytes,
        plan: DeletePlan,
    ) -> list[bytes]:
        """Drop an entry and its references inside ``txn``; returns blocks now at zero.

        A no-op (returns ``[]``) when the manifest is already gone, so two
        processes deleting the same entry never drop its references twice.
        """
        if self.get_manifest(digest, txn) is None:
            return []
        rec = self.get_entry(digest, txn)
        t = self.totals(txn)
        refs = self.db("refs")
        zeroed: list[bytes] = []
        stamp = now_ms()
        for d in dict.fromkeys(plan.blocks):
            raw = txn.get(d, db=refs)
            if raw is None or unpack_ref(bytes(raw)).refcount == 0:
                continue
            old = unpack_ref(bytes(raw))
            count = old.refcount - 1
            txn.put(d, pack_ref(RefInfo(count, old.size, stamp if count == 0 else 0)), db=refs)
            if count == 0:
                zeroed.append(d)
                t.zero_bytes += old.size
        prefix = self.db("prefix")
        for k, v in plan.prefix_items:
            txn.delete(k, v, db=prefix)
        if self.find_exact(plan.exact_key, txn) == digest:
            txn.delete(plan.exact_key, db=self.db("exact"))
        txn.delete(digest, db=self.db("manifests"))
        if txn.delete(digest, db=self.db("entries")):
            t.entries -= 1
            t.logical_bytes -= rec.logical_bytes if rec else 0
        self._put_totals(txn, t)
        return zeroed

    def drop_ref(self, txn: lmdb.Transaction, digest: bytes) -> RefInfo | None:
        """Remove a block's refs record (its file is unlinked by the caller, in ``txn``)."""
        refs = self.db("refs")
        raw = txn.get(digest, db=refs)
        if raw is None:
            return None
        ref = unpack_ref(bytes(raw))
        txn.delete(digest, db=refs)
        t = self.totals(txn)
        t.blocks -= 1
        t.physical_bytes -= ref.size
        if ref.refcount == 0:
            t.zero_bytes -= ref.size
        self._put_totals(txn, t)
        return ref

    # Raw records, for repair: they change one record and no total (``put_totals`` after).

    def put_ref(self, txn: lmdb.Transaction, digest: bytes, ref: RefInfo) -> None:
        txn.put(digest, pack_ref(ref), db=self.db("refs"))

    def delete_ref(self, txn: lmdb.Transaction, digest: bytes) -> None:
        txn.delete(digest, db=self.db("refs"))

    def put_prefix(self, txn: lmdb.Transaction, key: bytes, value: bytes) -> None:
        txn.put(key, value, db=self.db("prefix"), dupdata=True)

    def delete_prefix(self, txn: lmdb.Transaction, key: bytes, value: bytes) -> None:
        txn.delete(key, value, db=self.db("prefix"))

    def delete_exact(self, txn: lmdb.Transaction, key: bytes) -> None:
        txn.delete(key, db=self.db("exact"))

    def put_entry(self, txn: lmdb.Transaction, digest: bytes, rec: EntryRecord) -> None:
        txn.put(digest, encode(rec), db=self.db("entries"))

    def delete_entry(self, txn: lmdb.Transaction, digest: bytes) -> None:
        txn.delete(digest, db=self.db("entries"))

    def delete_records(self, txn: lmdb.Transaction, digest: bytes) -> None:
        """Drop a manifest and its entry record as they are (one that cannot be decoded)."""
        txn.delete(digest, db=self.db("manifests"))
        self.delete_entry(txn, digest)

    def put_totals(self, txn: lmdb.Transaction, t: Totals) -> None:
        self._put_totals(txn, t)
