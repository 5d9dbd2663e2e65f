"""The Store: the one place that composes blocks, the index and the codecs."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._crash import crash_point
from ..blocks import Digest, LocalBlockStore, from_hex
from ..codecs import AttachmentData
from ..errors import (
    BlockNotFoundError,
    CorruptBlockError,
    EntryNotFoundError,
    InvalidDigestError,
    ManifestError,
    NamespaceRequiredError,
    ReadOnlyStoreError,
    RemoteError,
)
from ..index import Index
from ..schema import (
    Manifest,
    Namespace,
    TensorSpec,
    decode_manifest,
)
from . import keys as P
from .access import AccessLog
from .counters import StoreCounters
from .diagnose import Diagnosis
from .entries import Entry, EntryInfo, Stats
from .files import FileBridge
from .gc import DEFAULT_GRACE, enforce_budget
from .lookup import (
    Match,
    find,
    has_reach_markers,
)
from .maintenance import Maintenance
from .restore import read_entry
from .root import Root, RootSettings, default_root, has_root, open_root
from .saving import CODEC_PROVIDER, PrefixGone, Priority, check_args, draft
from .served import Served
from .usage import failure_reason
from .views import IndexViews

if TYPE_CHECKING:  # the remote tier is imported when a store has one (issue 27, item 15)
    from ..remote import PushStats, Remote
    from .tiered import Pulled, RemoteLink

_log = logging.getLogger("kvstore")

_RESTORE_TRIES = 4  # lookups one restore makes when what it found went bad or away


class Store(FileBridge, IndexViews, Maintenance, Served):
    """A cache root: save caches, find the longest stored prefix, restore it."""

    max_bytes: int | None = None  # byte budget enforced after each save (Store.open)
    gc_grace: float = DEFAULT_GRACE  # seconds a zero-ref block waits before a budget unlinks it

    def __init__(
        self,
        root: Path,
        index: Index,
        settings: RootSettings,
        *,
        namespace: Namespace | None,
        durable: bool,
        verify_reads: bool,
        read_only: bool = False,
    ) -> None:
        self.root = root
        self.read_only = read_only
        self.index = index
        self.settings = settings
        self.namespace = namespace
        self.durable = durable
        self.verify_reads = verify_reads
        self.blocks = LocalBlockStore(root, settings.hash, durable=durable, read_only=read_only)
        self.parts = Root(root, settings, index, self.blocks)  # what gc and verify work on
        self._access = AccessLog(index, read_only=read_only)
        self._bisect = False  # lookups bisect the chain (set by open once the root allows it)
        self._link: RemoteLink | None = None
        self.counters = StoreCounters()
        self._diagnosis = Diagnosis(index, self._keys)

    @property
    def remote(self) -> Remote | None:
        """The remote tier (``Store.open(remote=...)``), or None."""
        return None if self._link is None else self._link.remote

    # --- opening -------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str] | None = None,
        *,
        namespace: Namespace | None = None,
        hash: str | None = None,
        block_tokens: int | None = None,
        state_block_bytes: int | None = None,
        durable: bool = True,
        create: bool = True,
        verify_reads: bool = True,
        map_size: int | None = None,
        max_bytes: int | None = None,
        gc_grace: float | None = None,
        read_only: bool | None = None,
        remote: str | None = None,
        remote_timeout: float | None = None,
        push: bool = True,
    ) -> Store:
        """Open (and, with ``create``, make) the root.

        ``hash`` and ``block_tokens`` are fixed when a root is created; passing
        other values for an existing root is a :class:`RootSettingsError`.
        With ``max_bytes`` every save that takes the live bytes over it evicts
        least-recently-used entries until they fit (see :mod:`kvstore.store.gc`);
        ``gc_grace`` (default 600 s) is the grace that eviction honours.

        ``verify_reads`` (the default) checks every block a restore, load or
        export reads against its digest, over the bytes read; ``False`` skips
        the hashing for raw speed, and a block damaged on disk is then returned
        as cache data (sizes and file types are still checked). See the README.

        ``remote`` (default ``$KVSTORE_REMOTE``; ``""`` for none) is an
        ``s3://BUCKET/PREFIX`` that this root shares with others: lookups consult it,
        restores pull from it, and saves are queued for upload (``push=False``: only
        :meth:`push` uploads). ``remote_timeout`` (default 5 s,
        ``kvstore.remote.DEFAULT_TIMEOUT``) bounds each request and each lookup. The
        remote tier's modules (and boto3) are imported only for a store that has one.
        """
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        path = Path(root) if root is not None else default_root()
        url = os.environ.get("KVSTORE_REMOTE", "") if remote is None else remote
        rem = None
        if url:
            from ..remote import DEFAULT_TIMEOUT, Remote
            from .tiered import RemoteLink

            rem = Remote(url, timeout=DEFAULT_TIMEOUT if remote_timeout is None
                         else remote_timeout)
        if rem is not None and create and not has_root(path) and hash is None \
                and block_tokens is None:  # a new root takes the remote's settings
            theirs = RemoteLink.settings_for_new_root(rem)
            if theirs is not None:
                hash, block_tokens = theirs.hash, theirs.block_tokens
                state_block_bytes = state_block_bytes or theirs.state_block_bytes
        try:
            index, settings, ro = open_root(path, hash=hash, block_tokens=block_tokens,
                                            state_block_bytes=state_block_bytes,
                                            durable=durable, create=create,
                                            map_size=map_size, read_only=read_only)
        except BaseException:
            if rem is not None:
                rem.close()
            raise
        store = cls(
            path,
            index,
            settings,
            namespace=namespace,
            durable=durable,
            verify_reads=verify_reads,
            read_only=ro,
        )
        store.max_bytes = max_bytes
        store._bisect = has_reach_markers(index, writable=not ro)
        if gc_grace is not None:
            store.gc_grace = gc_grace
        if rem is not None:
            try:
                store._link = RemoteLink.attach(store.parts, rem, create=create and not ro,
                                                push=push)
                store._link.counters = store.counters
            except BaseException:
                rem.close()
                store.close()
                raise
        return store

    def flush_access(self) -> None:
        """Write pending access stamps and lookup counts to the index now (see
        :mod:`kvstore.store.access`: they are also written a second after the first
        one, by :meth:`close` and at interpreter exit)."""
        self._access.flush()

    def close(self) -> None:
        """Push what is queued for the remote (bounded), write the pending access stamps and
        close the index (a second close does nothing)."""
        if self._link is not None:
            self._link.close()
        self._access.close(self.index.close)

    def push(self, timeout: float | None = None, *, everything: bool = False) -> PushStats:
        """Wait until the saves queued for the remote are on it (``everything``: first queue
        every local entry the remote lacks); returns what was uploaded."""
        return self._remote_link().push(timeout, everything=everything)

    def pull(self, entry_ids: Sequence[str] | None = None) -> list[Pulled]:
        """Download remote entries (all, or these ids or unique prefixes) into this root."""
        return self._remote_link().pull_entries(entry_ids)

    def _remote_link(self) -> RemoteLink:
        if self._link is None:
            raise ValueError("this store has no remote: Store.open(..., remote='s3://...')")
        return self._link

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
        return self.settings.block_tokens

    def _ns(self, namespace: Namespace | None) -> Namespace:
        ns = namespace or self.namespace
        if ns is None:
            raise NamespaceRequiredError(
                "no namespace: pass namespace=kvstore.Namespace(...) here or to Store.open"
            )
        return ns

    def _c0(self, ns: Namespace) -> bytes:
        return P.root_key(ns, CODEC_PROVIDER, self.block_tokens, self.settings.hash)

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
        """
        self._check_writable("save")
        ns = self._ns(namespace)
        meta = check_args(cache, metadata, priority)
        tk = self._keys(tokens, ns)
        n = len(tk)
        with self.index.read() as txn:
            existing = self.index.find_exact(tk.exact_key(), txn)
            rec = self.index.get_entry(existing, txn) if existing else None
        if existing and rec is not None:
            return EntryInfo(existing.hex(), n, rec.logical_bytes, 0, created=False)
        d = draft(self.parts, ns, tk, cache, attachments, meta, priority, created_at,
                  reuse_prefix=reuse_prefix, bisect=self._bisect)
        crash_point("before_commit")
        try:
            created = self.index.commit_save(d.plan)
        except PrefixGone:  # the transaction was aborted: save our own bytes instead
            return self.save(tk.tokens, cache, namespace=ns, metadata=meta, priority=priority,
                             attachments=attachments, created_at=d.created_at)
        crash_point("after_commit")
        if created and self._link is not None and self._link.auto_push:
            self._link.enqueue(d.digest)
        if created and self.max_bytes is not None:
            report = enforce_budget(self.parts, self.max_bytes, grace=self.gc_grace)
            if report is not None:
                self.counters.add(evicted_entries=len(report.evicted),
                                  freed_bytes=report.freed_bytes)
        if not created:  # a concurrent save of the same tokens won
            with self.index.read() as txn:
                existing = self.index.find_exact(d.plan.exact_key, txn)
            eid = existing.hex() if existing else d.digest.hex()
            return EntryInfo(eid, n, d.logical_bytes, d.new_bytes, created=False)
        return EntryInfo(d.digest.hex(), n, d.logical_bytes, d.new_bytes)

    # --- lookup ----------------------------------------------------------------------------

    def lookup(self, tokens: Any, *, namespace: Namespace | None = None) -> Match | None:
        """The longest usable stored prefix of ``tokens``, or None.

        Costs one hash per block of the query plus about log2(blocks) index
        seeks (a binary search over the chain), whatever the number of stored
        entries; a root without reach markers falls back to one seek per block.
        """
        match = self._find(tokens, namespace)
        self._access.note(lookup=True)
        return match

    def _find(self, tokens: Any, namespace: Namespace | None, *, remote: bool = True
              ) -> Match | None:
        tk = self._keys(tokens, self._ns(namespace))
        with self.index.read() as txn:
            match = find(self.index, txn, tk, bisect=self._bisect)
        if not remote or self._link is None or (match is not None and match.exact):
            return match
        hit = self._link.find(tk, match.length if match is not None else 0)
        if hit is None:
            return match
        return Match(Digest(hit.digest), hit.length, hit.exact, hit.trimmable, hit.n_tokens,
                     where="remote")

    def _keys(self, tokens: Any, ns: Namespace) -> P.TokenKeys:
        return P.TokenKeys.of(tokens, self._c0(ns), self.block_tokens, self.settings.hash)

    # --- load --------------------------------------------------------------------------------

    def manifest(self, entry_id: str | bytes) -> Manifest:
        """The decoded manifest of an entry."""
        digest = self._digest(entry_id)
        with self.index.read() as txn:
            raw = self.index.get_manifest(digest, txn)
        if raw is None:
            raise EntryNotFoundError(f"no entry {digest.hex()}")
        return decode_manifest(raw)

    def load(self, match: Match, *, verify: bool | None = None) -> list[Any]:
        """Restore the cache objects of ``match`` holding exactly ``match.length`` tokens.

        Reads only the first ``ceil(length / block_tokens)`` token blocks and the
        state blocks. A load counts as a hit of the :meth:`lookup` that found
        ``match`` (the ``store lookups`` of ``kvstore stats``) and stamps the entry's
        last access. ``verify`` (None: the store's ``verify_reads``) checks each
        block's digest over the bytes read. A missing block raises
        :class:`BlockNotFoundError`; a corrupt one (the wrong digest, the wrong
        size, not a regular file) is quarantined, the entries that need it are
        cut back or dropped (see :mod:`kvstore.store.repair`), and
        :class:`CorruptBlockError` names it: a new lookup then finds the
        longest intact prefix.
        """
        digest: bytes = match.digest
        if match.where == "remote":
            from ..remote import RemoteHit

            try:
                got = self._remote_link().pull(RemoteHit(
                    match.digest, match.length, match.exact, match.trimmable, match.n_tokens))
            except RemoteError:
                self.counters.add(remote_errors=1)
                raise
            self.counters.add(remote_pulls=1, remote_pulled_bytes=got.bytes)
            digest = got.digest
            if got.fresh and verify is None:  # every block was checked as it came in
                verify = False
        try:
            _, cache, _ = self._read(digest, match.length, verify)
        except CorruptBlockError:
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
        return read_entry(self.parts, digest, length, verify)

    def restore(
        self, tokens: Any, *, namespace: Namespace | None = None, verify: bool | None = None
    ) -> tuple[list[Any] | None, int]:
        """Lookup and load: ``(cache, length)`` of the longest intact stored prefix, or
        ``(None, 0)``.

        Never raises for what it finds on disk: a corrupt block is quarantined (see
        :meth:`load`) and the lookup is made again, so the caller gets the longest
        prefix still stored intact; a block or entry removed meanwhile (evicted by
        another process) is looked up again too.

        Counts one request of ``len(tokens)`` prompt tokens in the root's per-tier counts
        (:meth:`note_request`): ``length`` of them from this root or the remote, and why
        it missed when it did.
        """
        cache: list[Any] | None = None
        length = 0
        tried: set[tuple[bytes, int]] = set()
        self._access.note(lookup=True)  # one lookup, however many tries it takes
        remote = True
        where, failed = "local", None
        for _ in range(_RESTORE_TRIES):
            match = self._find(tokens, namespace, remote=remote)
            if match is None or (match.digest, match.length) in tried:
                break
            tried.add((match.digest, match.length))
            try:
                cache, length = self.load(match, verify=verify), match.length
                where = match.where
                break
            except (BlockNotFoundError, CorruptBlockError, EntryNotFoundError, ManifestError,
                    RemoteError) as e:
                failed = failed or failure_reason(e)
                if match.where == "remote":  # a local hit or a miss instead, never an error
                    remote = False
                    if self._link is not None:
                        self._link.down(f"restore of {match.entry_id} failed: {e}")
                continue
        # one request: the tokens it was given, what it reused and why not more
        miss = failed or (None if cache is not None else
                          self.miss_reason(tokens, namespace=namespace))
        self._access.note_request(len(tokens), length, where if cache is not None else None,
                                  miss)
        return (cache, length) if cache is not None else (None, 0)


__all__ = ["Entry", "EntryInfo", "Match", "Stats", "Store", "TensorSpec", "default_root"]
