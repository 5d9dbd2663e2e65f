"""The disk tier's write-behind queue: snapshots are saved on a worker thread, never on
the caller's, and a snapshot that would only rewrite a partial block waits.

**Write cost.** A root cuts every entry into token blocks of ``block_tokens`` (default
256); the last block of an entry is usually partial, and an entry that extends a stored
one by a few tokens writes that partial block again, whole. ``kvstore serve`` saves at
every segment end and every reply, so a chat whose turns add tens of tokens rewrote its
last block at every turn (6x the conversation's own KV bytes over six turns, measured in
docs/BENCHMARKS.md). Here a trimmable snapshot is written at once only when it holds a
whole token block that no stored or queued entry holds for the same leading tokens;
otherwise it is *deferred*: kept in memory, and replaced by the next snapshot of the same
conversation (one that starts with it; for a reply's snapshot, with its prompt). A deferred
snapshot is written when it has waited ``defer_seconds``, at :meth:`WriteBehind.drain`
and at close; ``queue_bytes`` bounds the queued and the deferred snapshots together, and
the oldest deferred ones are dropped first (what their conversation had before is
stored). ``defer_seconds=0`` writes every snapshot at once.
Caches that cannot be trimmed (hybrid and sliding-window checkpoints, which serve only
their exact length) are never deferred or replaced.

**Checkpoints** (``cache_type`` ``"checkpoint"``, saved with priority ``"checkpoint"``;
see :mod:`kvstore.mlx_lm.prefill`) are queued at once and never deferred. Memory stays
bounded: at most one checkpoint waits in the queue (beside the one being written); the
next :meth:`WriteBehind.submit` of a checkpoint blocks until the worker has taken the
waiting one. :meth:`WriteBehind.pending` finds a snapshot still queued or being written,
so a request that comes before its save still reuses it.

**One lookup per snapshot.** What the root holds for a snapshot's tokens
(:meth:`kvstore.Store.known`) is asked once, when it is decided whether to write it now
(else when it is saved), and passed to :meth:`kvstore.Store.save` as ``known``; it is
asked again only if this queue saved another snapshot meanwhile. What another writer
changed meanwhile, ``Store.save`` checks where it matters (see
:class:`kvstore.local.saving.Known`).
"""

from __future__ import annotations

import atexit
import collections
import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import cache as _cache

from kvstore import Namespace, Store
from kvstore.store import Known

from .prefill import CHECKPOINT

__all__ = ["SaveDone", "WriteBehind", "common_prefix"]

logger = logging.getLogger("kvstore.mlx_lm")

DEFAULT_DEFER_SECONDS = 300.0
_can_trim: Callable[[Any], bool] = _cache.can_trim_prompt_cache



def register_exit_flush(fn: Callable[[], None]) -> None:
    """Run `fn` at interpreter exit, before ``concurrent.futures`` shuts its pools.

    Plain ``atexit`` runs after ``threading``'s exit hooks, when thread pools
    (which the store may use to write blocks) refuse new work; ``threading``'s
    own hook list runs first, in reverse order of registration.
    """
    import concurrent.futures.thread  # noqa: F401  (its hook must be registered before ours)

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(fn)
    except RuntimeError:
        atexit.register(fn)


def cached_tokens(prompt_cache: Sequence[Any], n_tokens: int) -> int:
    """How many tokens the cache holds: the attention layers' offset, else `n_tokens`."""
    offsets: list[int] = []
    for c in prompt_cache:
        layers = getattr(c, "caches", None) or (c,)
        offsets.extend(int(x.offset) for x in layers if isinstance(getattr(x, "offset", None), int))
    return min(offsets) if offsets else n_tokens


@dataclass
class Job:
    namespace: Namespace
    tokens: list[int]
    cache: list[Any]
    cache_type: str  # "assistant", "user", "system" (mlx-lm's server's) or "checkpoint"
    nbytes: int
    trimmable: bool
    stem: int = 0  # a later snapshot sharing this many leading tokens replaces it
    since: float = 0.0  # time.monotonic() when it was deferred
    metadata: dict[str, str] | None = None  # stored instead of {"cache_type": cache_type}
    pin_ttl: float = 0.0  # a cache breakpoint's (seconds): saved pinned, never deferred
    known: Known | None = None  # what the root held for its tokens (Store.known), asked once
    asked: int = 0  # the queue's saves when ``known`` was asked (more since: asked again)


@dataclass(frozen=True)
class SaveDone:
    """One background save, for observers (metrics)."""

    seconds: float
    n_tokens: int
    new_bytes: int  # bytes written to block files
    logical_bytes: int  # what the entry's blocks add up to
    kv_bytes_added: int  # its logical bytes beyond the prefix the root held before it
    failed: bool = False


def cache_arrays(prompt_cache: Sequence[Any]) -> list[mx.array]:
    arrays: list[mx.array] = []
    for c in prompt_cache:
        leaves: Any = tree_flatten(c.state)
        arrays.extend(v for _, v in leaves if isinstance(v, mx.array))
    return arrays


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists (slice compares in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo] holds; a[:hi] differs
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class WriteBehind:
    """The queue, its worker thread and its counters; thread-safe."""

    def __init__(self, store: Store, *, queue_bytes: int, reuse_prefix: bool,
                 defer_seconds: float = DEFAULT_DEFER_SECONDS,
                 on_save: Callable[[SaveDone], None] | None = None) -> None:
        self.store = store
        self.queue_bytes = queue_bytes
        self.reuse_prefix = reuse_prefix
        self.defer_seconds = defer_seconds
        self.on_save = on_save
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._deferred: list[Job] = []  # oldest first
        self._queued_bytes = 0
        self._deferred_bytes = 0
        self._inflight = False
        self._current: Job | None = None  # the job being saved
        self._closed = False
        self._worker: threading.Thread | None = None
        self._saves = 0  # saves this queue made (a Job's ``known`` is stale after one)
        self.counts = collections.Counter[str]()  # guarded by _cond

    # --- what to do with a snapshot ---------------------------------------------------

    def submit(self, namespace: Namespace, tokens: list[int], prompt_cache: list[Any],
               cache_type: str, *, stem: int | None = None,
               metadata: dict[str, str] | None = None, pin_ttl: float = 0.0) -> str:
        """Queue or defer a snapshot of ``tokens`` (the cache holds exactly them); returns
        ``queued``, ``deferred`` or ``closed`` (dropped: the queue is closed).

        A checkpoint (``cache_type`` ``"checkpoint"``) is queued, never deferred, and waits
        here while another checkpoint waits in the queue. ``metadata`` is stored with the
        entry (default ``{"cache_type": cache_type}``). A cache breakpoint's snapshot
        (``pin_ttl`` > 0, seconds) is queued, never deferred, and saved pinned.

        ``stem`` (default: all of ``tokens``): a later snapshot that shares this many
        leading tokens with this one continues its conversation and replaces it while it
        is deferred (a reply's snapshot passes its request's prompt length: the next turn
        re-renders the reply, so it need not match the reply's own tokens)."""
        mx.eval(cache_arrays(prompt_cache))  # materialise here; the worker reads bytes only
        job = Job(namespace, tokens, list(prompt_cache), cache_type,
                  sum(int(c.nbytes) for c in prompt_cache), _can_trim(prompt_cache),
                  stem=len(tokens) if stem is None else min(stem, len(tokens)),
                  metadata=metadata, pin_ttl=pin_ttl)
        checkpoint = cache_type == CHECKPOINT
        defer = (not checkpoint and not pin_ttl and job.trimmable and self.defer_seconds > 0
                 and not self._new_block(job))
        with self._cond:
            if checkpoint:  # memory stays bounded: one checkpoint waits at most
                self._cond.wait_for(
                    lambda: self._closed
                    or not any(q.cache_type == CHECKPOINT for q in self._queue)
                )
            if self._closed:
                self.counts["dropped"] += 1
                return "closed"
            if job.trimmable and not checkpoint:
                self._drop_superseded(job)
            if defer:
                job.since = time.monotonic()
                self._deferred.append(job)
                self._deferred_bytes += job.nbytes
            else:
                self._append(job)
            self._shed()
            self._start_worker()
            self._cond.notify_all()
        return "deferred" if defer else "queued"

    def _new_block(self, job: Job) -> bool:
        """Whether ``job`` holds a whole token block beyond what is stored or queued for its
        leading tokens (then it is written at once)."""
        T = self.store.block_tokens
        n = len(job.tokens)
        if n // T == 0:
            return False
        have = 0
        with self._cond:  # the queue first, then the store: a job leaves the one for the other
            for q in [*self._queue, *([self._current] if self._current else [])]:
                if q.namespace == job.namespace and q.trimmable:
                    have = max(have, min(len(q.tokens), common_prefix(q.tokens, job.tokens)))
            asked = self._saves
        try:
            job.known = self.store.known(job.tokens, namespace=job.namespace)
            job.asked = asked
            have = max(have, job.known.stored)
        except Exception:  # noqa: BLE001 - the decision is advisory: write it
            logger.warning("kvstore: store lookup before a save failed", exc_info=True)
            return True
        return n // T > have // T

    def _drop_superseded(self, job: Job) -> None:
        """Drop the deferred snapshots that ``job`` continues: those whose ``stem`` it
        shares. (What a replaced reply snapshot held past its stem, the reply as generated
        rather than as the next turn renders it, is less than a block beyond what the root
        holds.) Under ``_cond``."""
        keep = []
        for d in self._deferred:
            if d.namespace == job.namespace and common_prefix(d.tokens, job.tokens) >= d.stem:
                self._deferred_bytes -= d.nbytes
                self.counts["superseded"] += 1
            else:
                keep.append(d)
        self._deferred = keep

    def _promote(self, job: Job) -> None:
        """Move a deferred snapshot to the queue; under ``_cond``."""
        self._deferred.remove(job)
        self._deferred_bytes -= job.nbytes
        self._append(job)

    def _append(self, job: Job) -> None:
        self._queue.append(job)
        self._queued_bytes += job.nbytes

    def _shed(self) -> None:
        """Keep what waits within ``queue_bytes``: drop the oldest deferred snapshots first
        (their conversation's earlier state is stored), then the oldest queued ones."""
        while self._deferred and self._queued_bytes + self._deferred_bytes > self.queue_bytes:
            old = self._deferred.pop(0)
            self._deferred_bytes -= old.nbytes
            self.counts["dropped"] += 1
            logger.warning("kvstore: write-behind memory full, dropped a deferred %d-token "
                           "snapshot", len(old.tokens))
        while self._queue and self._queued_bytes > self.queue_bytes:
            old = self._queue.popleft()
            self._queued_bytes -= old.nbytes
            self.counts["dropped"] += 1
            logger.warning(
                "kvstore: write-behind queue full, dropped a %d-token snapshot", len(old.tokens)
            )

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="kvstore-write-behind",
                                            daemon=True)
            self._worker.start()

    # --- the worker -----------------------------------------------------------------------

    def _next(self) -> Job | None:
        """The next job to save, promoting deferred ones that waited long enough; None when
        closed and empty. Under ``_cond``."""
        while True:
            now = time.monotonic()
            for d in [d for d in self._deferred if now - d.since >= self.defer_seconds]:
                self._promote(d)
            if self._queue:
                return self._queue.popleft()
            if self._closed:
                return None
            wait = None
            if self._deferred:
                wait = max(min(d.since for d in self._deferred) + self.defer_seconds - now, 0.01)
            self._cond.wait(wait)

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                if job is None:
                    return
                self._queued_bytes -= job.nbytes
                self._inflight = True
                self._current = job
                self._cond.notify_all()  # a checkpoint waiting for room may queue now
            done = self._save(job)
            del job
            with self._cond:
                self._saves += 1
                self._current = None
                if done.failed:
                    self.counts["failed"] += 1
                else:
                    self.counts.update(saved=1, bytes_written=done.new_bytes,
                                       logical_bytes_saved=done.logical_bytes,
                                       kv_bytes_added=done.kv_bytes_added)
                self._inflight = False
                self._cond.notify_all()
            if self.on_save is not None:
                try:
                    self.on_save(done)
                except Exception:  # noqa: BLE001 - an observer never stops the saves
                    logger.warning("kvstore: save observer failed", exc_info=True)

    def _save(self, job: Job) -> SaveDone:
        t0 = time.perf_counter()
        n = len(job.tokens)
        try:
            known = job.known
            if known is None or job.asked != self._saves:  # none yet, or this queue saved since
                known = self.store.known(job.tokens, namespace=job.namespace)
            have = known.stored
            info = self.store.save(
                job.tokens,
                job.cache,
                metadata=job.metadata or {"cache_type": job.cache_type},
                priority=job.cache_type,  # type: ignore[arg-type]
                namespace=job.namespace,
                reuse_prefix=self.reuse_prefix,
                pin_ttl=job.pin_ttl,
                known=known,
            )
        except Exception:
            logger.warning("kvstore: background save of %d tokens failed", n, exc_info=True)
            return SaveDone(time.perf_counter() - t0, n, 0, 0, 0, failed=True)
        added = int(info.logical_bytes) * (n - min(have, n)) // n if info.created else 0
        return SaveDone(time.perf_counter() - t0, n, int(info.new_bytes), int(info.logical_bytes),
                        added)

    def pending(self, namespace: Namespace, tokens: Sequence[int],
                have: int) -> tuple[int, list[Any]] | None:
        """``(n, cache)``: a copy of the snapshot queued, being written or deferred that
        serves the longest prefix ``n`` of ``tokens[:-1]``, more than ``have``; None when
        there is none. A snapshot whose tokens are that prefix serves it; a trimmable one
        also serves the prefix it shares with ``tokens`` (its copy cut back to it), as
        mlx-lm's LRU does: the next turn re-renders a reply's tokens. (A deferred snapshot
        is mlx-lm's memory tier's too, but its LRU may have evicted it since: concurrent
        conversations through a small LRU.)"""
        limit = len(tokens) - 1
        with self._cond:
            jobs = [*self._queue, *([self._current] if self._current is not None else []),
                    *self._deferred]
            best: Job | None = None
            best_n = have
            for j in jobs:
                if j.namespace != namespace:
                    continue
                if len(j.tokens) <= limit and list(tokens[: len(j.tokens)]) == j.tokens:
                    n = len(j.tokens)
                elif j.trimmable:
                    n = min(common_prefix(j.tokens, tokens), limit)
                else:
                    continue
                if n > best_n:
                    best, best_n = j, n
            if best is None:
                return None
            cache = copy.deepcopy(best.cache)
        if best_n < len(best.tokens):
            _cache.trim_prompt_cache(cache, len(best.tokens) - best_n)
        return best_n, cache

    def shared(self, namespace: Namespace, tokens: Sequence[int]) -> int:
        """The most leading tokens of ``tokens`` that a snapshot of ``namespace`` queued,
        being written or deferred holds, whether or not it can serve them (a cache that
        cannot be trimmed serves only its own length): what the store will share with
        ``tokens`` once the writer has saved it."""
        with self._cond:
            jobs = [*self._queue, *([self._current] if self._current is not None else []),
                    *self._deferred]
            return max((common_prefix(j.tokens, tokens) for j in jobs
                        if j.namespace == namespace), default=0)

    # --- waiting and closing ------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> bool:
        """Queue the deferred snapshots and wait until every one is saved (or failed)."""
        with self._cond:
            for d in list(self._deferred):
                self._promote(d)
            self._shed()
            if self._queue:
                self._start_worker()
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._queue and not self._inflight, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Drain, then stop the worker; later snapshots are dropped (counted)."""
        drained = self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and drained:
            worker.join(timeout)
        return drained

    def counters(self) -> dict[str, int]:
        """saved, failed, dropped, superseded, bytes_written, logical_bytes_saved,
        kv_bytes_added (a copy)."""
        with self._cond:
            return dict(self.counts)

    def state(self) -> tuple[int, int, int, int]:
        """(snapshots queued or being written, their bytes, deferred snapshots, their bytes)."""
        with self._cond:
            return (len(self._queue) + int(self._inflight), self._queued_bytes,
                    len(self._deferred), self._deferred_bytes)
