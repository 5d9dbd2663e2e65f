"""The Store: the facade over a root, the tiers below it and the work done on them."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Unpack

from .._crash import crash_point
from ..blocks import from_hex
from ..catalog import keys as P
from ..catalog.find import Match, find
from ..catalog.records import Priority
from ..codecs import AttachmentData
from ..errors import (
    BlockNotFoundError,
    DigestMismatchError,
    EntryNotFoundError,
    InvalidDigestError,
    KVStoreError,
    ManifestError,
    NamespaceRequiredError,
    ReadOnlyStoreError,
)
from ..local import IndexRead, Root, default_root
from ..local.gc import DEFAULT_GRACE, CompactReport, plan_budget
from ..local.restore import read_entry
from ..local.saving import CODEC_PROVIDER, Known, PrefixGone, ask, check_args, draft
from ..local.sweep import TempFiles
from ..local.verify import Progress, VerifyReport
from ..local.views import IndexViews
from ..schema import Manifest, Namespace, TensorSpec
from .access import AccessLog
from .counters import StoreCounters
from .entries import Entry, EntryInfo, PullReport, Stats
from .maintenance import Maintenance
from .opening import OpenOptions, StoreOptions, open_store
from .served import Served
from .tiers import Tiers
from .usage import Usage, failure_reason

if TYPE_CHECKING:  # the remote tier is imported when a store has one (issue 27, item 15)
    from ..catalog.base import PushStats
    from ..remote import Remote

_log = logging.getLogger("kvstore")

_RESTORE_TRIES = 4  # lookups one restore makes when what it found went bad or away
#: What a local restore finds gone or bad on disk: it looks up again (a lower tier's
#: failure of any kind is a fall back to this root).
_GONE = (BlockNotFoundError, DigestMismatchError, EntryNotFoundError, ManifestError)


class Store:
    """A cache root: save caches, find the longest stored prefix, restore it.

    A facade over named parts: ``local`` (the root: the local tier, with its catalog,
    block files and settings), ``tiers`` (the root and the tiers below it: lookups
    across them, write-back, write-behind), ``maintenance`` (listing, deleting,
    compaction, verification, totals), ``views`` (what the command line reads of the
    index) and ``served`` (per-tier request counts, miss reasons). ``root`` is the root's
    path; ``counters`` what this open store did, for ``/metrics``.

    A store is built whole (``Store.open`` builds one): its ``options``
    (:class:`~kvstore.store.opening.StoreOptions`, frozen), its ``counters`` and its
    remote are given to the constructor, which hands each part what it needs; nothing is
    set on a store or its parts afterwards (tests/test_architecture.py checks it).
    """

    def __init__(
        self,
        local: Root,
        options: StoreOptions = StoreOptions(),  # noqa: B008 - frozen
        *,
        remote: Remote | None = None,
        counters: StoreCounters | None = None,
    ) -> None:
        self.options = options
        self.local = local
        self.root: Path = local.path  # the root's directory
        self.counters = StoreCounters() if counters is None else counters
        self._access = AccessLog(local, read_only=options.read_only)
        self.tiers = Tiers(local, [remote] if remote is not None else [],
                           write_behind=options.push, deadline=options.remote_deadline,
                           counters=self.counters, retry=options.push_retry)
        self._remote = remote
        self.maintenance = Maintenance(local, self._access)
        self.views = IndexViews(local)
        self.served = Served(local, self._access, self.tiers, self._keys)

    # --- its options (:class:`~kvstore.store.opening.StoreOptions`), read-only -----------

    @property
    def namespace(self) -> Namespace | None:
        """The namespace of calls that pass none."""
        return self.options.namespace

    @property
    def verify_reads(self) -> bool:
        """Whether reads check each block's digest by default."""
        return self.options.verify_reads

    @property
    def read_only(self) -> bool:
        """Whether the root is open read-only."""
        return self.options.read_only

    @property
    def max_bytes(self) -> int | None:
        """The byte budget enforced after each save (None: none)."""
        return self.options.max_bytes

    @property
    def gc_grace(self) -> float:
        """Seconds a zero-ref block waits before a budget unlinks it."""
        return self.options.gc_grace

    @property
    def clock(self) -> Callable[[], int]:
        """The time pins are judged by (ms since the epoch)."""
        return self.options.clock

    @property
    def remote(self) -> Remote | None:
        """The remote tier (``Store.open(remote=...)``), or None."""
        return self._remote

    # --- opening (kvstore.store.opening) -----------------------------------------

    if TYPE_CHECKING:  # the signature of open_store, for the type checker

        @classmethod
        def open(cls, root: str | os.PathLike[str] | None = None,
                 **options: Unpack[OpenOptions]) -> Store: ...
    else:
        open = classmethod(open_store)

    def flush_access(self) -> None:
        """Write pending access stamps and lookup counts to the index now (see
        :mod:`kvstore.store.access`: they are also written a second after the first
        one, by :meth:`close` and at interpreter exit)."""
        self._access.flush()

    def close(self) -> None:
        """Push what is queued for the lower tiers (bounded), write the pending access stamps
        and close the index (a second close does nothing)."""
        self.tiers.close()
        self._access.close(self.local.close)

    def push(self, timeout: float | None = None, *, everything: bool = False,
             sign_pulled: bool = False) -> PushStats:
        """Wait until the saves queued for the remote are on it (``everything``: first queue
        every local entry the remote lacks); returns what was uploaded.

        With a signing key, an entry this root pulled without the key is not pushed (so
        not signed: nothing checked who wrote it; counted in ``pulled_unsigned``) unless
        ``sign_pulled`` (with ``everything``) says to sign it too."""
        return self.tiers.push(timeout, everything=everything, sign_pulled=sign_pulled)

    def pull(self, entry_ids: Sequence[str] | None = None) -> PullReport:
        """Download remote entries (all, or these ids or unique prefixes) into this root."""
        return self.tiers.pull(entry_ids)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers ---------------------------------------------------------------------

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ReadOnlyStoreError(f"{self.root} is open read-only: cannot {what}")

    @property
    def block_tokens(self) -> int:
        return self.local.settings.block_tokens

    def _ns(self, namespace: Namespace | None) -> Namespace:
        ns = namespace or self.namespace
        if ns is None:
            raise NamespaceRequiredError(
                "no namespace: pass namespace=kvstore.Namespace(...) here or to Store.open"
            )
        return ns

    def _keys(self, tokens: Any, ns: Namespace) -> P.TokenKeys:
        c0 = P.root_key(ns, CODEC_PROVIDER, self.block_tokens, self.local.settings.hash)
        return P.TokenKeys.of(tokens, c0, self.block_tokens, self.local.settings.hash)

    @staticmethod
    def _digest(entry_id: str | bytes) -> bytes:
        if isinstance(entry_id, bytes):
            if len(entry_id) != 32:
                raise InvalidDigestError(f"not a 32-byte entry id: {entry_id!r}")
            return entry_id
        return from_hex(entry_id)

    # --- save ----------------------------------------------------------------------------

    def save(
        self,
        tokens: Any,
        cache: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        metadata: dict[str, str] | None = None,
        priority: Priority = "assistant",
        attachments: Sequence[AttachmentData] = (),
        reuse_prefix: bool = False,
        created_at: int | None = None,
        pin_ttl: float = 0,
        known: Known | None = None,
    ) -> EntryInfo:
        """Store ``cache`` (a list of mlx-lm cache objects) as the state after ``tokens``.

        Identical blocks already on disk cost nothing; saving the same tokens
        again in the same namespace returns the existing entry.

        ``reuse_prefix=True`` skips hashing the leading full token blocks that a
        stored entry of the same namespace and layout already holds for the
        same tokens, and references that entry's blocks instead. Use it when
        the cache was extended from one this root saved (the next turn of a
        conversation): its leading rows are then those very bytes. For a cache
        computed independently the entry gets the stored rows for the shared
        prefix, which hold the same tokens' state but may differ in the last bits.

        ``created_at`` (ms since the epoch, default now) is the manifest's creation
        time, part of what names the entry: an imported file passes its own, so
        importing it again after a removal gives back the same entry id.

        ``pin_ttl`` (seconds; 0: none) pins the entry, a cache breakpoint's: it is kept from
        eviction (the budget after a save, ``compact``) until ``pin_ttl`` has passed since
        its last use, within the pins' share of the budget (:mod:`kvstore.local.gc`);
        an entry saved again with a pin gets it (the longer of the two) and a fresh use.

        ``known`` (:meth:`known`, for the same tokens and namespace) is what the root held
        for them when the caller asked, reused instead of asking again: one lookup per
        snapshot. It may be stale; see :class:`~kvstore.local.saving.Known` for how
        each part of it is checked where it is used.
        """
        self._check_writable("save")
        if not pin_ttl >= 0:  # NaN too
            raise ValueError(f"pin_ttl must be >= 0 seconds, got {pin_ttl}")
        pin_ms = int(pin_ttl * 1000)
        ns = self._ns(namespace)
        meta = check_args(cache, metadata, priority)
        tk = self._keys(tokens, ns)
        n = len(tk)
        key = tk.exact_key()
        if known is not None and known.key != key:
            raise ValueError("known was asked for other tokens, namespace or root settings")
        fresh = known is None
        if known is None:
            known = ask(self.local, tk, prefix=reuse_prefix)
        while known.exact is not None:  # stored already: confirm what was not just asked
            digest, logical = known.exact
            if pin_ms:  # its write transaction says whether the entry is still there
                there = self.local.catalog.pin(digest, pin_ms, self.clock())
            else:
                there = fresh or self.local.catalog.exact(key) == digest
            if there:
                return EntryInfo(digest.hex(), n, logical, 0, created=False)
            if fresh:  # removed since: save it anew
                break
            known, fresh = ask(self.local, tk, prefix=reuse_prefix), True
        d = draft(self.local, ns, tk, cache, attachments, meta, priority, created_at,
                  reuse=known if reuse_prefix else None, pin_ttl=pin_ms)
        r = d.records
        crash_point("before_commit")
        try:
            created = self.local.catalog.commit(r, d.ensure)
        except PrefixGone:  # the transaction was aborted: save our own bytes instead
            return self.save(tk.tokens, cache, namespace=ns, metadata=meta, priority=priority,
                             attachments=attachments, created_at=r.created_at, pin_ttl=pin_ttl)
        crash_point("after_commit")
        if created and self.tiers.write_behind:
            self.tiers.enqueue(r.digest)
        if created and self.max_bytes is not None:
            report = plan_budget(self.local, self.max_bytes, grace=self.gc_grace,
                                 now=self.clock()).execute()
            self.counters.add(evicted_entries=len(report.evicted),
                              freed_bytes=report.freed_bytes)
        if not created:  # a concurrent save of the same tokens won
            eid = (self.local.catalog.exact(r.exact_key) or r.digest).hex()
            return EntryInfo(eid, n, r.logical_bytes, d.new_bytes, created=False)
        return EntryInfo(r.digest.hex(), n, r.logical_bytes, d.new_bytes)

    def touch(self, tokens: Any, *, namespace: Namespace | None = None) -> bool:
        """Count a use of the local entry of exactly ``tokens`` (its last access, which a
        pin's TTL runs from) without a lookup or a hit; False when there is none. For a
        caller that served those tokens from memory (a cache breakpoint reused there)."""
        tk = self._keys(tokens, self._ns(namespace))
        digest = self.local.catalog.exact(tk.exact_key())
        if digest is None:
            return False
        self._access.touch(digest)
        return True

    # --- lookup ----------------------------------------------------------------------------

    def lookup(self, tokens: Any, *, namespace: Namespace | None = None,
               deadline: float | None = None) -> Match | None:
        """The longest usable stored prefix of ``tokens``, or None.

        Costs one hash per block of the query plus about log2(blocks) index
        seeks (a binary search over the chain), whatever the number of stored
        entries; a root without reach markers falls back to one seek per block.
        ``deadline`` (seconds; None: the store's ``remote_deadline``) bounds this
        lookup's wait for the remote tier and the pull of what it found there
        (:meth:`Tiers.find <kvstore.store.tiers.Tiers.find>`).
        """
        match = self._find(tokens, namespace, deadline=deadline)
        self._access.note(lookup=True)
        return match

    def _find(self, tokens: Any, namespace: Namespace | None, *, lower: bool = True,
              deadline: float | None = None) -> Match | None:
        tk = self._keys(tokens, self._ns(namespace))
        if lower:
            return self.tiers.search(tk, deadline=deadline)
        with self.local.catalog.reader() as r:
            return find(r, tk)

    # --- load --------------------------------------------------------------------------------

    def manifest(self, entry_id: str | bytes) -> Manifest:
        """The decoded manifest of an entry."""
        digest = self._digest(entry_id)
        got = self.local.catalog.manifest(digest)
        if got is None:
            raise EntryNotFoundError(f"no entry {digest.hex()}")
        return got[1]

    def load(self, match: Match, *, verify: bool | None = None) -> list[Any]:
        """Restore the cache objects of ``match`` holding exactly ``match.length`` tokens.

        Reads only the first ``ceil(length / block_tokens)`` token blocks and the
        state blocks. A load counts as a hit of the :meth:`lookup` that found
        ``match`` (the hit rate of ``kvstore stats``) and stamps the entry's last
        access. ``verify`` (None: the store's ``verify_reads``) checks each
        block's digest over the bytes read. A missing block raises
        :class:`BlockNotFoundError`; a corrupt one (the wrong digest, the wrong
        size, not a regular file) is quarantined, the entries that need it are
        cut back or dropped (see :mod:`kvstore.local.repair`), and
        :class:`CorruptBlockError` names it: a new lookup then finds the
        longest intact prefix. A match of a lower tier is first written back
        into this root (:meth:`Tiers.fetch`).
        """
        digest: bytes = match.digest
        if match.where != self.local.name:
            got = self.tiers.fetch(match)  # counted there
            if got is None:  # the store is closing
                raise EntryNotFoundError(f"{match.entry_id} not pulled: this store is closing")
            digest = got.digest
            if got.fresh and verify is None:  # every block was checked as it came in
                verify = False
        try:
            _, cache, _ = self._read(digest, match.length, verify)
        except DigestMismatchError:
            self.counters.add(corrupt_blocks=1)
            raise
        self._access.note(digest)
        return cache

    def load_entry(
        self, entry_id: str | bytes, *, verify: bool | None = None
    ) -> tuple[list[int], list[Any], list[AttachmentData]]:
        """Tokens, cache and attachments of a whole entry (for export); as :meth:`load`."""
        m, cache, atts = self._read(self._digest(entry_id), None, verify)
        return list(P.tokens_from_le(m.tokens)), cache, atts

    def _read(
        self, digest: bytes, length: int | None, verify: bool | None
    ) -> tuple[Manifest, list[Any], list[AttachmentData]]:
        verify = self.verify_reads if verify is None else verify
        return read_entry(self.local, digest, length, verify)

    def restore(
        self, tokens: Any, *, namespace: Namespace | None = None, verify: bool | None = None
    ) -> tuple[list[Any] | None, int]:
        """Lookup and load: ``(cache, length)`` of the longest intact stored prefix, or
        ``(None, 0)``.

        Never raises for what it finds on disk: a corrupt block is quarantined (see
        :meth:`load`) and the lookup is made again, so the caller gets the longest
        prefix still stored intact; a block or entry removed meanwhile (evicted by
        another process) is looked up again too. A lower tier that fails is left alone
        and the lookup made again on this root.

        Counts one request of ``len(tokens)`` prompt tokens in the root's per-tier counts
        (:meth:`note_request`): ``length`` of them from this root or a lower tier, and why
        it missed when it did.
        """
        cache: list[Any] | None = None
        length = 0
        tried: set[tuple[bytes, int]] = set()
        self._access.note(lookup=True)  # one lookup, however many tries it takes
        lower = True
        where, failed = self.local.name, None
        for _ in range(_RESTORE_TRIES):
            match = self._find(tokens, namespace, lower=lower)
            if match is None or (match.digest, match.length) in tried:
                break
            tried.add((match.digest, match.length))
            try:
                cache, length = self.load(match, verify=verify), match.length
                where = match.origin or match.where
                break
            except (KVStoreError, OSError) as e:
                if match.where == self.local.name and not isinstance(e, _GONE):
                    raise
                failed = failed or failure_reason(e)
                if match.where != self.local.name:  # a local hit or a miss instead
                    lower = False  # a bad entry is the entry's fault, not the tier's:
                    if not isinstance(e, ManifestError | DigestMismatchError):
                        self.tiers.down(match.where, f"restore of {match.entry_id} failed: {e}")
        # one request: the tokens it was given, what it reused and why not more
        miss = failed or (None if cache is not None else self.miss_reason(tokens,
                                                                          namespace=namespace))
        self._access.note_request(len(tokens), length, where if cache is not None else None,
                                  miss)
        return (cache, length) if cache is not None else (None, 0)

    # --- files (mlx-bun v3/v4/v5, see kvstore.store.bridge) ----------------------------

    def import_file(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        namespace: Namespace | None = None,
    ) -> EntryInfo:
        """Store an mlx-bun v3/v4/v5 file as one entry (:func:`.bridge.read_file`: a
        malformed file raises its FileFormatError and leaves the store unchanged). The
        entry's namespace is ``namespace``, else the header's identity, else the store's."""
        from .bridge import read_file  # the formats: imported by the calls that use them

        self._check_writable("import")
        f = read_file(path, verify=verify)
        return self.save(f.tokens, f.cache, namespace=namespace or f.namespace,
                         metadata=f.metadata, attachments=f.attachments, priority=f.priority,
                         created_at=f.created_at)

    def export(
        self,
        entry_id: str | bytes,
        path: str | os.PathLike[str],
        *,
        format: Literal["v3", "v5"] = "v3",
        verify: bool = True,
    ) -> Path:
        """Write one entry as an mlx-bun file (see :func:`kvstore.store.bridge.write_file`)
        and return its path; ``entry_id`` may be a unique hex prefix.

        Every block's digest is checked over the bytes read (whatever the store's
        ``verify_reads``: a file written from damaged bytes would carry fresh hashes
        of them); a bad block is a :class:`CorruptBlockError` naming it,
        quarantined as a restore would, and no file is written. ``verify=False``
        skips the check.
        """
        if format not in ("v3", "v5"):
            raise ValueError(f"format must be 'v3' or 'v5', not {format!r}")
        eid = self.resolve(entry_id) if isinstance(entry_id, str) else entry_id
        m = self.manifest(eid)
        tokens, cache, attachments = self.load_entry(eid, verify=verify)
        from .bridge import write_file

        return write_file(m, tokens, cache, attachments, path, format=format)

    # --- maintenance (kvstore.store.maintenance) -------------------------------------

    def entries(self, *, namespace: Namespace | None = None) -> Iterator[Entry]:
        """Every entry (or those of one namespace), in id order, read in batches."""
        return self.maintenance.entries(namespace)

    def resolve(self, entry_id: str) -> str:
        """A full entry id from a unique prefix of at least ``MIN_ID_PREFIX`` (4) hex chars."""
        return self.maintenance.resolve(entry_id)

    def delete(self, entry_id: str | bytes) -> bool:
        """Remove an entry and drop its block references; False when it did not exist."""
        self._check_writable("delete an entry")
        return self.maintenance.delete(self._digest(entry_id))

    def compact(self, *, max_bytes: int | None = None, namespace_max_bytes: int | None = None,
                grace: float = DEFAULT_GRACE, dry_run: bool = False,
                progress: Progress | None = None) -> CompactReport:
        """Evict above the byte budgets, delete expired garbage (:mod:`kvstore.local.gc`);
        ``dry_run``: the plan's report, nothing done; ``progress(phase, done, total)``
        follows the work."""
        if not dry_run:
            self._check_writable("compact")
        return self.maintenance.compact(max_bytes, namespace_max_bytes, grace, dry_run,
                                        progress, now=self.clock())

    def verify(self, *, read_data: bool = False, repair: bool = False, dry_run: bool = False,
               progress: Progress | None = None) -> VerifyReport:
        """Check refcounts, blocks and keys (and, with ``read_data``, every block's
        bytes); ``repair`` fixes what it finds, ``dry_run`` only says how. See
        :func:`kvstore.local.verify.verify`."""
        if repair:
            self._check_writable("repair")
        return self.maintenance.verify(read_data, repair, dry_run, progress)

    def temp_files(self) -> TempFiles:
        """What ``tmp/`` holds: writes in progress, and files a writer that is gone left (a
        save killed midway), which the next compact removes whatever its grace."""
        return self.maintenance.temp_files()

    # --- served requests (kvstore.store.served) ------------------------------------------

    def note_request(self, prompt_tokens: int, reused_tokens: int = 0, tier: str | None = None,
                     *, miss: str | None = None) -> None:
        """Count one served request in the root's per-tier request counts.

        ``tier`` (``memory``, ``local`` or ``remote``) gave the ``reused_tokens`` leading
        tokens of a prompt of ``prompt_tokens``; ``miss`` is why it reused nothing or
        less than it might have (:data:`kvstore.store.usage.MISS_REASONS`).
        :meth:`restore` and :class:`~kvstore.mlx_lm.PersistentPromptCache` count their own
        requests; a caller that serves prompts through :meth:`lookup` and :meth:`load`
        reports its own here. The counts are written within a second (``kvstore stats``).
        """
        self.served.note_request(prompt_tokens, reused_tokens, tier, miss)

    def usage(self) -> Usage:
        """The root's request counts, over its lifetime and since the last reset."""
        return self.served.usage()

    def reset_usage(self) -> Usage:
        """Start the root's since-reset request counts anew; returns them as they were."""
        self._check_writable("reset the request counts")
        return self.served.reset_usage()

    def known(self, tokens: Any, *, namespace: Namespace | None = None) -> Known:
        """What this root holds for ``tokens``, asked once to decide a save and make it
        (pass it to :meth:`save` as ``known``): the entry that is exactly them, the
        longest local prefix (``.stored`` tokens) and its leading token blocks. Local only,
        not counted as a lookup."""
        return ask(self.local, self._keys(tokens, self._ns(namespace)))

    def miss_reason(self, tokens: Any, *, namespace: Namespace | None = None,
                    reused: int = 0) -> str | None:
        """Why the store gave no more than ``reused`` leading tokens of ``tokens``
        (:meth:`kvstore.store.diagnose.Diagnosis.reason`); None when it holds no more."""
        return self.served.miss_reason(tokens, self._ns(namespace), reused)

    def parting(self, tokens: Any, *, namespace: Namespace | None = None
                ) -> tuple[int, list[int] | None]:
        """How many leading tokens of ``tokens`` the deepest entry of this root shares with
        it (exactly), and that entry's next tokens when it goes on past them, where the
        two part (:meth:`kvstore.store.diagnose.Diagnosis.parting`)."""
        return self.served.parting(tokens, self._ns(namespace))

    def stats(self) -> Stats:
        """Entries, blocks, logical vs physical bytes and the dedup ratio."""
        return self.maintenance.stats()

    def quarantined(self) -> int:
        """How many blocks the root's ``quarantine/`` holds (moved aside as corrupt)."""
        return self.local.blocks.quarantined()

    # --- views (kvstore.local.views) ---------------------------------------------------

    def lookup_reads(self, tokens: Any, *, namespace: Namespace | None = None
                     ) -> list[IndexRead]:
        """The index reads a local lookup of ``tokens`` makes: each get and each cursor move."""
        return self.views.lookup_reads(self._keys(tokens, self._ns(namespace)))

    def replay_reads(self, reads: list[IndexRead]) -> int:
        """Those reads as plain gets in one read transaction; how many found a value."""
        return self.views.replay_reads(reads)


__all__ = ["Entry", "EntryInfo", "Known", "Match", "Stats", "Store", "StoreOptions", "TensorSpec",
           "default_root"]
