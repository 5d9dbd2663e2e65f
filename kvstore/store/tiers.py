"""A store's tiers in order: this machine's root first, then the tiers below it (a remote).

As an overlay of stores (dulwich's ``OverlayObjectStore``) or a storage manager over
backends (LMCache): a lookup asks each lower tier only for a match longer than the best
found above it, within the tier's ``timeout``; a tier that failed or was slow is left
alone for a while (one warning; :class:`~.health.Health` keeps each tier's state), so a
dead gateway costs a lookup nothing. A hit in a lower tier is **written back**, always
by :meth:`Tiers.fetch`: the blocks its prefix needs and its records (priority included)
are copied into the root (:meth:`Root.take <kvstore.local.root.Root.take>`, with
the blocks :meth:`~kvstore.local.root.Root.lacking` found), so the next restore of
it on this machine is local. A save is **written behind**: queued, then copied into each
lower tier by worker threads, never on the caller's thread. Every copy between tiers
goes through :meth:`Tier.take`, with the records of :func:`records_of`.

``Tiers`` is itself a tier (:class:`~kvstore.catalog.base.Tier`): its ``catalog`` and
``blocks`` present the root and the tiers below it as one (:mod:`.composed`), and pass the
shared catalog and block-store suites.

With a ``deadline`` (``Store.open(remote_deadline=...)``; ``kvstore serve`` sets one), a
lookup and the pull of what it found in a lower tier together take at most that many
seconds: what is not in the root by then is not used (the caller computes it), and the
lookup or pull goes on in the background (:class:`~.background.Background`: one per entry
at a time, a bounded queue, stopped at close) so that the next lookup finds it in the
root. A tier the deadline cut is not waited for during a while (each lookup asks it in
the background) unless one of those lookups answers in time.

A push that fails is tried again after a growing pause, a bounded number of times within
a bounded time (:class:`PushRetry`); what is given up is counted, and kept for the next
:meth:`Tiers.push`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..blocks import BlockStore, Digest
from ..catalog.base import Copied, PushStats, Tier
from ..catalog.find import Match, find
from ..catalog.keys import TokenKeys
from ..catalog.records import Records, cut_manifest, encoded, records_of
from ..catalog.signing import UnsignedManifestError
from ..errors import DigestMismatchError, EntryNotFoundError, KVStoreError, ManifestError
from ..local import Root
from .background import Background
from .composed import ComposedBlocks, ComposedCatalog
from .counters import StoreCounters
from .entries import Pulled, PullReport, resolve_id
from .errors import TierTimeoutError
from .health import DEFAULT_DEADLINE as DEFAULT_DEADLINE  # kvstore serve's
from .health import Health
from .retry import PushRetry, Retries

_log = logging.getLogger("kvstore")

DEFAULT_QUEUE = 1024  # entries waiting to be written behind before saves are shed
DEFAULT_CLOSE_TIMEOUT = 10.0  # seconds close() waits for queued copies
PULL_RATE = 10e6  # bytes/s a write-back is allowed at least, on top of the tier's timeout


class Tiers(Tier):
    """The root and the tiers below it, owned by a :class:`~kvstore.store.Store`;
    thread-safe. As a tier it is named as its root, and read-only when the root is."""

    def __init__(self, root: Root, lower: Sequence[Tier] = (), *, write_behind: bool = True,
                 deadline: float | None = None, counters: StoreCounters | None = None,
                 retry: PushRetry | None = None, queue_size: int = DEFAULT_QUEUE,
                 workers: int = 2) -> None:
        """``deadline``: :attr:`deadline`; ``counters``: the store's (what the tiers did is
        counted there; None: their own); ``retry``: :attr:`retry` (None: the default
        schedule). All are fixed for the tiers' life."""
        self.root = root
        self.lower = list(lower)
        self.name = root.name
        self.blocks: ComposedBlocks = ComposedBlocks(self)
        self.catalog: ComposedCatalog = ComposedCatalog(self, self.blocks)
        self.write_behind = write_behind and bool(self.lower)
        self._pending: dict[str, Callable[[], object]] = {}  # run before a tier's first use
        self._q: queue.Queue[bytes | None] = queue.Queue(maxsize=queue_size)
        self._cv = threading.Condition()
        self._outstanding = 0
        self._stats = PushStats()
        self._failed = Retries()  # pushes waiting to be tried again, or given up
        self.retry = PushRetry() if retry is None else retry
        self._queued: set[bytes] = set()  # in the queue or being copied
        #: Entries pulled unsigned that a push was told to sign (``push(sign_pulled=True)``).
        self._sign_pulled: set[bytes] = set()
        self._workers: list[threading.Thread] = []
        self._n_workers = workers
        self._requests = cf.ThreadPoolExecutor(4, thread_name_prefix="kvstore-tier-lookup")
        self._closed = False
        self.counters = StoreCounters() if counters is None else counters
        #: The lower tiers' health and the request deadline (:attr:`deadline`).
        self.health = Health(deadline)
        self.pulls = Background(name="kvstore-pull")
        self._ends: dict[tuple[str, bytes], float] = {}  # when a running pull is overdue

    @property
    def deadline(self) -> float | None:
        """Seconds a lookup and the pull of what it found below the root may take together
        (None: each tier's own bounds); :attr:`health`'s, fixed at construction (a lookup
        may pass its own: :meth:`find`)."""
        return self.health.deadline

    def later(self, tier: Tier, first: Callable[[], object], why: object) -> None:
        """Run ``first`` before ``tier`` is used (it was unreachable: its settings are
        checked at its first use), and leave it alone for a while."""
        self._pending[tier.name] = first
        self.health.bench(tier.name)
        _log.warning("kvstore: %s %s unreachable, working locally: %s", tier.name, tier, why)

    def _ready(self, tier: Tier) -> None:
        first = self._pending.get(tier.name)
        if first is not None:
            first()
            self._pending.pop(tier.name, None)

    def tier(self, name: str) -> Tier:
        for t in self.lower:
            if t.name == name:
                return t
        raise ValueError(f"no tier {name!r} below this root")

    def below(self, *, writing: bool = False) -> list[Tier]:
        """The tiers below the root, in order, each ready for use: to read, those lookups
        ask now (not benched; one whose first use fails is benched and left out); to
        write, every one."""
        out = []
        for t in self.lower:
            if not writing and self.health.benched(t.name):
                continue
            try:
                self._ready(t)
            except (KVStoreError, OSError) as e:
                if writing:
                    raise
                self._failed_lookup(t, e)
                continue
            out.append(t)
        return out

    # --- lookups -----------------------------------------------------------------------

    def search(self, tk: TokenKeys, *, deadline: float | None = None) -> Match | None:
        """The best match of ``tk`` in any tier: the root's, then :meth:`find` below it (the
        store's lookup, and the composed catalog's); ``deadline`` as :meth:`find`'s."""
        with self.root.catalog.reader() as r:
            best = find(r, tk)
        return self.find(tk, best, deadline=deadline)

    def find(self, tk: TokenKeys, best: Match | None, *,
             deadline: float | None = None) -> Match | None:
        """The best match of ``tk`` given the root's ``best``: a lower tier's when longer.

        With a deadline (``deadline``, this lookup's; None: :attr:`deadline`), a lower
        tier's hit is fetched into the root (:meth:`fetch`) before this returns (the match
        is then the root's, ``origin`` names the tier), or not used (``best`` is returned,
        the pull goes on in the background)."""
        deadline = self.deadline if deadline is None else deadline
        until = self.health.until(deadline)
        for tier in self.lower:
            if best is not None and best.exact:
                break
            hit = self._find_in(tier, tk, best.length if best is not None else 0, until,
                                deadline)
            if hit is not None:
                best = hit if until is None else self._pulled_by(tier, tk, hit, best, until)
        return best

    def _find_in(self, tier: Tier, tk: TokenKeys, floor: int, until: float | None = None,
                 deadline: float | None = None) -> Match | None:
        if self.health.benched(tier.name):
            return None
        now = self.health.clock()
        ask = self.health.ask(tier.name, tier.timeout, until)
        if ask.skip is not None:
            if ask.background:  # not waited for, asked all the same
                self._in_background(tier, self._requests.submit(self._find_now, tier, tk,
                                                                floor), now, deadline)
            self._missed(tier, ask.skip, deadline)
            return None
        fut = self._requests.submit(self._find_now, tier, tk, floor)
        try:
            return fut.result(timeout=ask.wait)
        except cf.TimeoutError:
            if not ask.cut:
                self._failed_lookup(tier, f"no answer in {tier.timeout} s")
                return None
        except (KVStoreError, OSError) as e:
            self._failed_lookup(tier, e)
            return None
        self.health.cut(tier.name)
        self._missed(tier, "the lookup", deadline)
        self._in_background(tier, fut, now, deadline)
        return None

    def _in_background(self, tier: Tier, fut: cf.Future[Match | None], began: float,
                       deadline: float | None) -> None:
        self.health.late()
        fut.add_done_callback(lambda f: self._late_lookup(tier, f, began, deadline))

    def _failed_lookup(self, tier: Tier, why: object) -> None:
        self.counters.add(remote_errors=1)
        self.down(tier, why)

    def _late_lookup(self, tier: Tier, fut: cf.Future[Match | None], began: float,
                     deadline: float | None) -> None:
        """A lookup the deadline left running (or not waited for) answered: fetch what it
        found, in the background; the tier is waited for again if it answered in time."""
        self.health.answered(tier.name, began, deadline)
        if fut.cancelled():
            return
        e = fut.exception()
        if e is not None:
            if isinstance(e, (KVStoreError, OSError)):
                self._failed_lookup(tier, e)
            return
        hit = fut.result()
        if hit is not None and not self._closed:
            self._start(tier, hit, quiet=True)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until no lookup a deadline left running and no background pull is left
        (False on timeout)."""
        end = None if timeout is None else time.monotonic() + timeout
        if not self.health.settle(timeout):
            return False
        return self.pulls.wait(None if end is None else max(0.0, end - time.monotonic()))

    def _pulled_by(self, tier: Tier, tk: TokenKeys, hit: Match, best: Match | None,
                   until: float) -> Match | None:
        """``hit`` (of ``tier``) fetched into the root by ``until`` and found there again
        (the root's own lookup says how it serves ``tk``), or ``best`` (the pull goes
        on)."""
        try:
            got = self.fetch(hit, until, quiet=True)
        except (KVStoreError, OSError):  # counted and logged by the pull (_pull_failed)
            return best
        if got is None:
            return best
        with self.root.catalog.reader() as r:
            here = find(r, tk)
        if here is None or (best is not None and here.length <= best.length):
            return best
        return replace(here, origin=tier.name)

    def _missed(self, tier: Tier, what: str, deadline: float | None = None) -> None:
        """Count (and now and then log) a request the deadline (``deadline``, the
        request's; None: :attr:`deadline`) cut short."""
        self.counters.add(remote_deadline_misses=1)
        if self.health.warn_due():
            d = self.deadline if deadline is None else deadline
            _log.warning("kvstore: %s %s past %s remote deadline (%s): computed here, pulled "
                         "in the background", tier.name, tier,
                         "its" if d is None else f"the {d:g} s", what)

    def _find_now(self, tier: Tier, tk: TokenKeys, floor: int) -> Match | None:
        self._ready(tier)
        with tier.catalog.reader() as r:
            return find(r, tk, floor=floor)

    @property
    def unavailable(self) -> bool:
        """Whether lookups leave a lower tier alone now, or do not wait for it (it failed,
        timed out or was cut by the deadline recently)."""
        return self.health.unavailable(t.name for t in self.lower)

    def down(self, tier: Tier | str, why: object) -> None:
        """Leave a tier alone for a while after a failure (one warning each time)."""
        t = self.tier(tier) if isinstance(tier, str) else tier
        self.health.bench(t.name)
        _log.warning("kvstore: %s %s not used for %.0f s: %s", t.name, t,
                     self.health.down_for, why)

    # --- the one pull route: a lower tier's hit written back into the root ----------------

    def fetch(self, match: Match, until: float | None = None, *,
              quiet: bool = False) -> Pulled | None:
        """Write ``match`` (a lower tier's) back into the root: the blocks its prefix needs
        (cut at the block boundary past ``match.length`` when the entry can be cut) and its
        records. Every pull goes this way, on a background thread (one per entry at a
        time), counted there (``remote_pulls``, ``remote_errors``).

        Waits until ``until`` (:meth:`Health.until <kvstore.store.health.Health.until>`)
        and returns None if the pull is not done by then (it goes on, so that the next
        lookup finds it in the root); with no ``until``, waits the tier's own bound (its
        timeout twice over plus the bytes the root lacks at ``PULL_RATE``) and raises a
        :class:`TierTimeoutError` past it. A failed pull raises; ``quiet`` (a request
        that does not use the error) logs it instead, and benches the tier unless the
        entry was at fault."""
        tier = self.tier(match.where)
        key, fut = self._start(tier, match, quiet=quiet)
        if fut is None:  # shed: the queue of pulls is full
            if until is not None or self.pulls.closed:
                return None
            return self._pull(tier, match, key)  # the caller waits for it: on its thread
        if until is not None:
            try:
                return fut.result(timeout=max(0.0, until - time.monotonic()))
            except cf.TimeoutError:
                self._missed(tier, f"the pull of {match.entry_id}")
                return None
            except cf.CancelledError:
                return None
        if tier.timeout is None:
            return fut.result()
        first = tier.timeout * 2  # until the pull starts, then its own bound
        with self._cv:  # the pull moves its bound once it knows the bytes the root lacks
            asked = time.monotonic()
            while not fut.done():
                end = self._ends.get(key, asked + first)
                left = end - time.monotonic()
                if left <= 0:
                    self.counters.add(remote_errors=1)
                    raise TierTimeoutError(f"{tier}: a pull of {match.entry_id} had no answer "
                                           f"in {end - asked:.0f} s")
                self._cv.wait(left)
        return fut.result()

    def _start(self, tier: Tier, match: Match, *, quiet: bool
               ) -> tuple[tuple[str, bytes], cf.Future[Pulled] | None]:
        """The pull of ``match`` in the background (the one running already, if any)."""
        key = (tier.name, bytes(match.digest))
        fut = self.pulls.submit(key, lambda: self._pull(tier, match, key))
        if fut is None:
            if not self.pulls.closed:
                self.counters.add(remote_pulls_shed=1)
            return key, None
        fut.add_done_callback(self._wake)
        if quiet:
            fut.add_done_callback(lambda f: self._pull_failed(tier, match, f))
        return key, fut

    def _wake(self, _: object) -> None:
        with self._cv:
            self._cv.notify_all()

    def _pull_failed(self, tier: Tier, match: Match, fut: cf.Future[Pulled]) -> None:
        """Log a failed pull nobody asked to hear of, and bench its tier unless the entry
        was at fault (a lying manifest, a bad block)."""
        if fut.cancelled():
            return
        e = fut.exception()
        if isinstance(e, (ManifestError, DigestMismatchError)):
            _log.warning("kvstore: pull of %s from %s failed: %s", match.entry_id, tier, e)
        elif isinstance(e, (KVStoreError, OSError)):
            self.down(tier, f"pull of {match.entry_id} failed: {e}")

    def _pull(self, tier: Tier, match: Match, key: tuple[str, bytes]) -> Pulled:
        """The one function that writes a lower tier's hit back into the root (each
        request bounded by the tier's own timeouts); counted."""
        began = time.monotonic()
        if tier.timeout is not None:
            with self._cv:
                self._ends[key] = began + tier.timeout * 2
                self._cv.notify_all()
        try:
            got = self._write_back(tier, match, key, began)
        except BaseException:
            self.counters.add(remote_errors=1)
            raise
        finally:
            with self._cv:
                self._ends.pop(key, None)
                self._cv.notify_all()
        self.counters.add(remote_pulls=1, remote_pulled_bytes=got.bytes)
        return got

    def _write_back(self, tier: Tier, match: Match, key: tuple[str, bytes],
                    began: float) -> Pulled:
        self._ready(tier)
        got, rec = tier.catalog.manifest(match.digest), tier.catalog.records(match.digest)
        if got is None or rec is None:
            raise EntryNotFoundError(f"no entry {match.entry_id} on the {tier.name} tier")
        m = got[1]
        _check_match(match, rec, tier.catalog.where(match.digest))
        short = cut_manifest(m, -(-match.length // m.block_tokens)) if match.trimmable else None
        if short is not None:
            raw, digest = encoded(short)
            rec = records_of(short, raw, digest, priority=rec.priority)
        # nobody checked who wrote what a tier without a key gives: a keyed push won't sign it
        rec = replace(rec, pulled_unsigned=not tier.signed)
        lacking = self.root.lacking(rec)  # each block inspected once, here
        if tier.timeout is not None:
            with self._cv:
                self._ends[key] = began + tier.timeout * 2 + lacking.size / PULL_RATE
                self._cv.notify_all()
        copied = self.root.take(rec, tier.blocks, lacking)
        digest = rec.digest
        if not copied.created:  # the same tokens were committed here meanwhile
            digest = self.root.catalog.exact(rec.exact_key) or digest
        tier.note_access(match.digest)
        return Pulled(digest, rec.n_tokens, copied.blocks, copied.bytes, copied.present == 0)

    def pull(self, entry_ids: Sequence[str] | None) -> PullReport:
        """Write back whole entries of the first lower tier: every complete one (but those a
        reader with the signing key refuses), or these ids (unique prefixes). An entry that
        cannot be copied (a lying manifest, a bad or missing block, a refused signature) is
        reported and the others are pulled; it leaves no block behind
        (:meth:`Root.take <kvstore.local.root.Root.take>`)."""
        tier = self._first()
        self._ready(tier)
        listed = {d.hex(): d for d in tier.catalog}
        ids = list(listed) if entry_ids is None else [resolve_id(i, listed) for i in entry_ids]
        out = PullReport()
        for i in ids:
            try:
                rec = tier.catalog.records(listed[i]) if i in listed else None
                if rec is None:
                    raise EntryNotFoundError(f"no entry {i} on {tier}")
                got = self.fetch(Match(Digest(listed[i]), rec.n_tokens, True, rec.trimmable,
                                       rec.n_tokens, where=tier.name))
                if got is None:  # not with no deadline: the store is closing
                    raise KVStoreError(f"{i} not pulled: this store is closing")
                out.pulled.append(got)
            except UnsignedManifestError as e:  # refused (logged and counted): never pulled
                if entry_ids is not None:  # asked for by name: say why it was not
                    out.failed[i] = str(e)
            except (KVStoreError, OSError) as e:
                out.failed[i] = str(e)
        return out  # the caller says what failed (kvstore pull names each)

    def _first(self) -> Tier:
        if not self.lower:
            raise ValueError("this store has no remote: Store.open(..., remote='s3://...')")
        return self.lower[0]

    # --- the composed tier (kvstore.catalog.base.Tier) ----------------------------------

    def take(self, rec: Records, source: BlockStore) -> Copied:
        """Copy an entry into the root (:meth:`Root.take
        <kvstore.local.root.Root.take>`), then write it behind to the tiers below."""
        got = self.root.take(rec, source)
        if got.created:
            self.written(rec.digest)
        return got

    def written(self, digest: bytes) -> None:
        """An entry was committed to the root: queued for the tiers below (a save's
        write-behind), when this store writes behind."""
        if self.write_behind:
            self.enqueue(digest)

    def pushed(self, digest: bytes, timeout: float = DEFAULT_CLOSE_TIMEOUT) -> bool:
        """Wait until no copy of ``digest`` to the tiers below is queued or running (False
        on timeout)."""
        with self._cv:
            return self._cv.wait_for(lambda: digest not in self._queued, timeout)

    def note_access(self, digest: bytes) -> None:
        self.root.note_access(digest)

    def flush(self) -> None:
        """Wait until what is written behind is on the tiers below (:meth:`push`, which
        flushes them), and flush the root."""
        self.root.flush()
        if self.lower:
            self.push()

    # --- write-behind ----------------------------------------------------------------

    def enqueue(self, digest: bytes) -> None:
        """Queue a root entry for the lower tiers; shed (and count) when the queue is full."""
        if self._closed or not self.lower:
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
            try:
                d = self._q.get(timeout=self._until_due())
            except queue.Empty:
                self._retry_due()
                continue
            if d is None:
                return
            try:
                st = self._push_one(d)
            except Exception as e:  # noqa: BLE001 - counted, kept, tried again (PushRetry)
                st = PushStats(failed=1, errors=[f"{d.hex()}: {e}"])
                self._push_failed(d, e)
            else:
                with self._cv:
                    self._failed.done(d)
            self.counters.add(remote_pushes=st.entries, remote_pushed_bytes=st.bytes,
                              remote_errors=st.failed)
            with self._cv:
                self._stats.add(st)
                self._queued.discard(d)
                self._outstanding -= 1
                self._cv.notify_all()

    def _push_failed(self, d: bytes, e: Exception) -> None:
        """Schedule the next try of a failed push, or give it up (:attr:`retry`)."""
        with self._cv:
            if not self._failed:
                _log.warning("kvstore: push to %s failed (tried again up to %d times): %s",
                             self._first(), self.retry.attempts, e)
            tries = self._failed.failed(d, time.monotonic(), self.retry)
            if tries is None:
                self._stats.retried += 1
                return
            self._stats.given_up += 1
        self.counters.add(remote_pushes_given_up=1)
        _log.warning("kvstore: push of %s to %s given up after %d tries (kvstore push uploads "
                     "it): %s", d.hex(), self._first(), tries, e)

    def _until_due(self) -> float | None:
        """Seconds until the next failed push is due to be tried again (None: none is)."""
        with self._cv:
            left = self._failed.next_due(time.monotonic())
        return None if left is None else min(1.0, max(0.01, left))

    def _retry_due(self) -> None:
        with self._cv:  # handed over and queued at once (push() waits for either)
            for d in self._failed.due(time.monotonic()):
                self.enqueue(d)

    def _push_one(self, digest: bytes) -> PushStats:
        rec = self.root.catalog.records(digest)
        if rec is None:
            return PushStats()  # deleted or evicted locally meanwhile
        st = PushStats()
        for tier in self.lower:
            if tier.signed and rec.pulled_unsigned and digest not in self._sign_pulled:
                st.pulled_unsigned += 1  # signing it would vouch for whoever wrote it
                continue
            self._ready(tier)
            got = tier.take(rec, self.root.blocks)
            st.add(PushStats(entries=1, blocks=got.blocks, bytes=got.bytes,
                             present=got.present))
        return st

    def push(self, timeout: float | None = None, *, everything: bool = False,
             sign_pulled: bool = False) -> PushStats:
        """Wait until what is queued (and what failed before) is on the lower tiers, a
        failed upload being tried again as :attr:`retry` says, until it is given up; with
        ``everything``, first queue every root entry the first lower tier lacks, or holds
        but does not trust (with a signing key: pushed unsigned; pushing it signs it).

        A tier that signs is not given the entries this root pulled without the key
        (:attr:`Records.pulled_unsigned <kvstore.catalog.records.Records.pulled_unsigned>`:
        nothing checked who wrote them; counted in ``pulled_unsigned``) unless
        ``sign_pulled`` (with ``everything``) says to sign them too."""
        tier = self._first()
        with self._cv:
            retry = self._failed.take()  # tried now, their counts afresh
        for d in retry:
            self.enqueue(d)
        if everything:
            self._ready(tier)
            have = set(tier.catalog)
            for d in self.root.catalog:
                if d not in have or not tier.catalog.trusts(d):
                    if sign_pulled:
                        with self._cv:
                            self._sign_pulled.add(d)
                    self.enqueue(d)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._outstanding or self._failed.scheduled():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(left)
            st, self._stats = self._stats, PushStats()
            st.pending = self._outstanding
            if not self._outstanding:
                self._sign_pulled.clear()
            st.failed = len(self._failed)  # entries not on it (not tries that failed)
        for t in self.lower:
            t.flush()
        return st

    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT) -> PushStats:
        """Push what is queued (bounded by ``timeout``), then stop the threads and close the
        lower tiers."""
        if self._closed or not self.lower:
            self._closed = True
            return PushStats()
        end = time.monotonic() + timeout
        if self.pulls.close(timeout):
            _log.warning("kvstore: a pull from %s still running at close", self._first())
        st = PushStats()
        try:
            st = self.push(max(0.0, end - time.monotonic()))
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
                         "them)", st.pending + st.failed, self._first())
        self._requests.shutdown(wait=False, cancel_futures=True)
        for t in self.lower:
            t.close()
        return st


def _check_match(match: Match, rec: Records, where: str) -> None:
    """A ManifestError when ``match`` (a lower tier's lookup's) claims what the entry's
    manifest contradicts: another length or trimmability, more tokens than the entry
    holds, or a shorter prefix of an entry that cannot be cut. The lookup checks each
    marker against the manifest (kvstore.remote.catalog); this is the last look before
    its blocks are used, and a lie found here is the entry's fault, never the tier's."""
    if (match.trimmable != rec.trimmable or match.n_tokens != rec.n_tokens
            or not 0 < match.length <= rec.n_tokens
            or (not rec.trimmable and match.length != rec.n_tokens)):
        raise ManifestError(
            f"{where}: a match of {match.length} tokens of an entry of {match.n_tokens} "
            f"({'trimmable' if match.trimmable else 'exact length only'}) contradicts its "
            f"manifest ({rec.n_tokens} tokens, "
            f"{'trimmable' if rec.trimmable else 'exact length only'}): not used")
