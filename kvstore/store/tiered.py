"""The store's side of the remote tier: write-behind pushes, bounded lookups and pulls.

A save commits locally and queues its entry; worker threads publish it (never the
caller's thread). A lookup asks the remote only for what is longer than the local
match, and gives up after ``remote_timeout``; a remote that failed is left alone for
``DOWN_FOR`` seconds (one warning), so a dead gateway costs a lookup nothing. A pull
downloads the blocks a prefix needs, verified, into the local root and commits the
entry there, so the next restore of it on this machine is local.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..codecs.layout import manifest_blocks
from ..errors import EntryNotFoundError, KVStoreError, RemoteError, RemoteUnavailableError
from ..remote import PushStats, Remote, RemoteHit, RemoteSettings
from ..schema import decode_manifest
from . import keys as P
from .counters import StoreCounters
from .entries import resolve_id
from .plans import cut_manifest, encoded, entry_plan, publication
from .root import Root

_log = logging.getLogger("kvstore")

DEFAULT_QUEUE = 1024  # entries waiting for upload before saves are shed
DEFAULT_CLOSE_TIMEOUT = 10.0  # seconds close() waits for queued uploads
DOWN_FOR = 30.0  # seconds a failed remote is not asked again by lookups
PULL_RATE = 10e6  # bytes/s a pull is allowed at least, on top of remote_timeout


@dataclass(frozen=True)
class Pulled:
    """A remote entry (or its prefix) committed locally."""

    digest: bytes  # the local entry (the remote's, or its cut-back prefix)
    n_tokens: int
    blocks: int  # downloaded
    bytes: int
    fresh: bool = False  # every block it needs was downloaded (and checked) just now


class RemoteLink:
    """Owned by a :class:`~kvstore.store.Store` with a remote; thread-safe."""

    def __init__(self, parts: Root, remote: Remote, *, push: bool = True,
                 queue_size: int = DEFAULT_QUEUE, workers: int = 2) -> None:
        self.parts = parts
        self.remote = remote
        self.auto_push = push
        self._q: queue.Queue[bytes | None] = queue.Queue(maxsize=queue_size)
        self._cv = threading.Condition()
        self._outstanding = 0
        self._stats = PushStats()
        self._failed: dict[bytes, None] = {}
        self._queued: set[bytes] = set()  # in the queue or being uploaded
        self._workers: list[threading.Thread] = []
        self._n_workers = workers
        self._lookups = cf.ThreadPoolExecutor(4, thread_name_prefix="kvstore-remote-lookup")
        self._down_until = 0.0
        self._closed = False
        self.counters = StoreCounters()  # the store's own, once attached (Store.open)

    @staticmethod
    def settings_for_new_root(remote: Remote) -> RemoteSettings | None:
        """The remote's settings, for a root about to be created (None: none, or unreachable)."""
        try:
            return remote.read_settings()
        except RemoteUnavailableError:
            return None
        except BaseException:
            remote.close()
            raise

    @classmethod
    def attach(cls, parts: Root, remote: Remote, *, create: bool, push: bool) -> RemoteLink:
        """Check the remote's settings against the root's (see :meth:`Remote.attach`).

        An unreachable remote is a warning, not an error: the store works locally and
        the remote's settings are checked at its first use.
        """
        url = str(remote.url)
        s = parts.settings
        mine = RemoteSettings(hash=s.hash, block_tokens=s.block_tokens,
                              state_block_bytes=s.state_block_bytes, created_at=s.created_at)
        link = cls(parts, remote, push=push)
        try:
            remote.attach(mine, create=create)
        except RemoteUnavailableError as e:
            _log.warning("kvstore: remote %s unreachable, working locally: %s", url, e)
            link._mine = mine
            link._down_until = time.monotonic() + DOWN_FOR
        except BaseException:
            remote.close()
            raise
        return link

    _mine: RemoteSettings | None = None

    def _ready(self) -> None:
        """Check the settings once, for a remote that was unreachable at open."""
        if self._mine is not None:
            self.remote.attach(self._mine, create=True)
            self._mine = None

    # --- pushing -------------------------------------------------------------------

    def enqueue(self, digest: bytes) -> None:
        """Queue a local entry for upload; shed (and count) when the queue is full."""
        if self._closed:
            return
        with self._cv:
            if digest in self._queued:
                return
            try:
                self._q.put_nowait(digest)
            except queue.Full:
                if not self._stats.shed:
                    _log.warning("kvstore: remote upload queue full: saves are not pushed "
                                 "(kvstore push uploads them later)")
                self._stats.shed += 1
                return
            self._outstanding += 1
            self._queued.add(digest)
            if len(self._workers) < self._n_workers:
                t = threading.Thread(target=self._work, name="kvstore-push", daemon=True)
                self._workers.append(t)
                t.start()

    def _work(self) -> None:
        while True:
            d = self._q.get()
            if d is None:
                return
            try:
                st = self._push_one(d)
            except Exception as e:  # noqa: BLE001 - counted, kept, retried by the next push
                st = PushStats(failed=1, errors=[f"{d.hex()}: {e}"])
                with self._cv:
                    if not self._failed:
                        _log.warning("kvstore: push to %s failed: %s", self.remote.url, e)
                    self._failed[d] = None
            self.counters.add(remote_pushes=st.entries, remote_pushed_bytes=st.bytes,
                              remote_errors=st.failed)
            with self._cv:
                self._stats.add(st)
                self._queued.discard(d)
                self._outstanding -= 1
                self._cv.notify_all()

    def _push_one(self, digest: bytes) -> PushStats:
        self._ready()
        idx = self.parts.index
        with idx.read() as txn:
            raw = idx.get_manifest(digest, txn)
        if raw is None:
            return PushStats()  # deleted or evicted locally meanwhile
        pub = publication(decode_manifest(raw), raw, digest)
        blocks = self.parts.blocks
        lease = self.remote.lease
        return self.remote.publish(pub, lambda d: blocks.get(d, verify=True),
                                   max_wait=lease.duration + lease.margin)

    def push(self, timeout: float | None = None, *, everything: bool = False) -> PushStats:
        """Wait until what is queued (and what failed before) is on the remote; with
        ``everything``, first queue every local entry the remote lacks."""
        with self._cv:
            retry, self._failed = list(self._failed), {}
        for d in retry:
            self.enqueue(d)
        if everything:
            self._ready()
            have = self.remote.complete_entries()
            idx = self.parts.index
            with idx.read() as txn:
                mine = [d for d, _ in idx.iter_entries(txn)]
            for d in mine:
                if d not in have:
                    self.enqueue(d)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._outstanding:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(left)
            st, self._stats = self._stats, PushStats()
            st.pending = self._outstanding
        self.remote.flush_access()
        return st

    # --- lookup and pull -------------------------------------------------------------

    def find(self, tk: P.TokenKeys, floor: int) -> RemoteHit | None:
        """The remote's match longer than ``floor`` tokens, within ``remote_timeout``;
        None (and one warning) when the remote fails or is slow."""
        if time.monotonic() < self._down_until:
            return None
        fut = self._lookups.submit(self._find, tk, floor)
        try:
            return fut.result(timeout=self.remote.timeout)
        except (RemoteError, cf.TimeoutError) as e:
            self.counters.add(remote_errors=1)
            self.down(e if isinstance(e, RemoteError) else f"no answer in {self.remote.timeout} s")
            return None

    def _find(self, tk: P.TokenKeys, floor: int) -> RemoteHit | None:
        self._ready()
        return self.remote.find(tk.chain, tk.le, tk.exact_key(), floor)

    @property
    def unavailable(self) -> bool:
        """Whether lookups leave the remote alone now (it failed or timed out recently)."""
        return time.monotonic() < self._down_until

    def down(self, why: object) -> None:
        """Leave the remote alone for a while after a failure (one warning each time)."""
        self._down_until = time.monotonic() + DOWN_FOR
        _log.warning("kvstore: remote %s not used for %.0f s: %s", self.remote.url, DOWN_FOR, why)

    def pull(self, hit: RemoteHit) -> Pulled:
        """Download what ``hit`` needs (verified), store it locally and commit its entry."""
        raw, m = self.remote.manifest(hit.digest)
        short = cut_manifest(m, -(-hit.length // m.block_tokens)) if hit.trimmable else None
        if short is not None:
            raw, digest = encoded(short)
            m = short
        else:
            digest = hit.digest
        blocks = self.parts.blocks
        need = list(dict.fromkeys(m.block_digests()))
        missing = [d for d in need if not blocks.exists(d)]
        sizes = manifest_blocks(m)
        nbytes = sum(sizes[d] for d in missing)

        def fetch(d: bytes) -> None:  # download (verified) and store, on a request thread
            blocks.put(d, [self.remote.blocks.get(d)])

        self._bounded(lambda: self.remote.map(fetch, missing), nbytes)

        def ensure(d: bytes) -> None:  # in the commit: a local GC took it meanwhile
            if not blocks.exists(d):
                fetch(d)

        plan = entry_plan(m, raw, digest, ensure_block=ensure)
        if not self.parts.index.commit_save(plan):
            with self.parts.index.read() as txn:
                digest = self.parts.index.find_exact(plan.exact_key, txn) or digest
        self.remote.note_access(hit.digest)
        return Pulled(digest, m.n_tokens, len(missing), nbytes, len(missing) == len(need))

    def pull_entries(self, entry_ids: Sequence[str] | None) -> list[Pulled]:
        """Pull whole remote entries: every finished one, or these ids (unique prefixes)."""
        self._ready()
        done = self.remote.complete_entries()
        listed = {e.id: e for e in self.remote.entries() if e.complete}
        ids = list(listed) if entry_ids is None else [resolve_id(i, listed) for i in entry_ids]
        out = []
        for i in ids:
            if i not in listed:
                raise EntryNotFoundError(f"no entry {i} on {self.remote.url}")
            d, n = bytes.fromhex(i), listed[i].n_tokens
            out.append(self.pull(RemoteHit(d, n, True, done.get(d, False), n)))
        return out

    def _bounded(self, fn: Callable[[], object], nbytes: int) -> None:
        """Run ``fn`` within ``remote_timeout`` twice over plus ``nbytes`` at PULL_RATE."""
        budget = self.remote.timeout * 2 + nbytes / PULL_RATE
        fut = self._lookups.submit(fn)
        try:
            fut.result(timeout=budget)
        except cf.TimeoutError:
            raise RemoteUnavailableError(f"pull: no answer in {budget:.0f} s",
                                         bucket=self.remote.url.bucket) from None

    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT) -> PushStats:
        """Push what is queued (bounded by ``timeout``), then stop the threads."""
        if self._closed:
            return PushStats()
        st = PushStats()
        try:
            st = self.push(timeout)
        except KVStoreError as e:
            _log.warning("kvstore: push at close failed: %s", e)
        self._closed = True
        for _ in self._workers:
            try:
                self._q.put_nowait(None)
            except queue.Full:
                break
        if st.pending or st.failed:
            _log.warning("kvstore: %d entries not pushed to %s at close (kvstore push uploads "
                         "them)", st.pending + st.failed, self.remote.url)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self.remote.close()
        return st

