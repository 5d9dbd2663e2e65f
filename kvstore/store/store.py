"""The Store: the one place that composes blocks, the index and the codecs."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from ..blocks import BlockCheck, BlockStore, from_hex, new_hasher
from ..codecs import AttachmentData, RawCache, codec_for_record, snapshot
from ..codecs.layout import manifest_block_sizes, n_token_blocks
from ..errors import (
    BlockNotFoundError,
    CacheMismatchError,
    CorruptBlockError,
    EntryNotFoundError,
    InvalidDigestError,
    KVStoreError,
    ManifestError,
    NamespaceRequiredError,
    ReadOnlyStoreError,
)
from ..index import DeletePlan, EntryRecord, Index, SavePlan, now_ms
from ..schema import (
    Attachment,
    Layer,
    ListLayer,
    Manifest,
    Namespace,
    TensorSpec,
    decode_manifest,
    encode_manifest,
    iter_tensor_specs,
)
from . import keys as P
from ._crash import crash_point
from .bridge import Priority, read_file, write_file
from .gc import CompactReport, compact, enforce_budget
from .lookup import (
    REACH_META,
    Match,
    add_reach_markers,
    delete_plan,
    find,
    prefix_items,
    trimmable,
)
from .reader import Want, load_arrays, plan_runs
from .repair import plan_for_blocks
from .root import Root, RootSettings, default_root, open_root
from .verify import VerifyReport, verify
from .writer import place, write_blocks

_log = logging.getLogger("kvstore")

CODEC_PROVIDER = "kvstore-mlx/1"
ACCESS_FLUSH_SECONDS = 1.0  # how long access stamps may wait in memory before a write
_RESTORE_TRIES = 4  # lookups one restore makes when what it found went bad or away
PRIORITIES = {"assistant": 0, "user": 1, "system": 2}
MIN_ID_PREFIX = 4  # hex chars of an entry id that resolve() accepts


@dataclass(frozen=True)
class EntryInfo:
    """What a save produced: the entry id, its size, and the bytes newly written.

    ``created`` is False when the entry was already stored (the same tokens in the
    same namespace): the save returned it and wrote nothing.
    """

    id: str
    n_tokens: int
    logical_bytes: int
    new_bytes: int
    created: bool = True


@dataclass(frozen=True)
class Entry:
    """One stored entry, as listed by :meth:`Store.entries`."""

    id: str
    namespace: Namespace
    n_tokens: int
    logical_bytes: int
    created_at: int
    last_access: int
    hits: int
    priority: str


@dataclass(frozen=True)
class Stats:
    entries: int
    blocks: int
    logical_bytes: int
    physical_bytes: int
    dedup_ratio: float
    lookups: int
    hits: int


_ns_json = msgspec.json.Encoder()
_ns_dec = msgspec.json.Decoder(Namespace)
_PRIORITY_NAMES = {v: k for k, v in PRIORITIES.items()}


def _leaves(layers: Sequence[Layer]) -> Iterator[Layer]:
    for layer in layers:
        if isinstance(layer, ListLayer):
            yield from _leaves(layer.children)
        else:
            yield layer


class Store:
    """A cache root: save caches, find the longest stored prefix, restore it."""

    max_bytes: int | None = None  # byte budget enforced after each save (Store.open)
    gc_grace: float = 600.0  # seconds a zero-ref block waits before that enforcement unlinks it

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
        self.blocks = BlockStore(root, settings.hash, durable=durable, read_only=read_only)
        self.parts = Root(root, settings, index, self.blocks)  # what gc and verify work on
        # Access stamps and hit counts are advisory (they order evictions), so
        # they are batched: a timer writes them ACCESS_FLUSH_SECONDS after the
        # first one (never on the caller's path), close() and interpreter exit
        # write what is left.
        self._lock = threading.Lock()  # guards the pending counts and the timer
        self._flush_lock = threading.Lock()  # one flush at a time, none after close
        self._hits: dict[bytes, int] = {}
        self._lookups = 0
        self._found = 0
        self._pid = os.getpid()  # whose the pending counts are (a forked child drops them)
        self._timer: threading.Timer | None = None
        self._closed = False
        self._bisect = False  # lookups bisect the chain (set by open once the root allows it)
        self._exit_hook = _exit_flush(self)
        atexit.register(self._exit_hook)

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
    ) -> Store:
        """Open (and, with ``create``, make) the root.

        ``hash`` and ``block_tokens`` are fixed when a root is created; passing
        other values for an existing root is a :class:`RootSettingsError`.
        With ``max_bytes`` every save that takes the live bytes over it evicts
        least-recently-used entries until they fit (see :mod:`kvstore.store.gc`);
        ``gc_grace`` (default 600 s) is the grace that eviction honours.
ACCESS_FLUSH_SECONDS = 1.0  # how long access stamps may wait in memory before a write

        ``verify_reads`` (the default) checks every block a restore, load or
        export reads against its digest, over the bytes read; ``False`` skips
        the hashing for raw speed, and a block damaged on disk is then returned
        as cache data (sizes and file types are still checked). See the README.
        """
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        path = Path(root) if root is not None else default_root()
        index, settings, ro = open_root(
            path,
            hash=hash,
            block_tokens=block_tokens,
            state_block_bytes=state_block_bytes,
            durable=durable,
            create=create,
            map_size=map_size,
            read_only=read_only,
        )
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
        store._bisect = _has_reach_markers(index, writable=not ro)
        if gc_grace is not None:
            store.gc_grace = gc_grace
        return store

    def flush_access(self) -> None:
        """Write pending access stamps and lookup counts to the index now.

        They are also written ACCESS_FLUSH_SECONDS after the first one, by
        :meth:`close` and at interpreter exit. Best effort: they only order
        evictions and feed the hit rate, so an index that cannot be written (a
        read-only root, say) drops them with a log line instead of failing the
        restore or the close that flushes them. A store opened read-only drops
        them silently.
        """
        with self._flush_lock:
            if not self._closed:
                self._write_access()

    def _write_access(self) -> None:
        """Write the pending counts; the caller holds ``_flush_lock``."""
        with self._lock:
            self._adopt_after_fork()
            hits, self._hits = self._hits, {}
            lookups, found = self._lookups, self._found
            self._lookups = self._found = 0
        if self.read_only:
            return
        try:
            self.index.record_access(hits, lookups=lookups, found=found)
        except KVStoreError as e:
            _log.warning("kvstore: access stamps not recorded: %s", e)

    def _adopt_after_fork(self) -> None:
        """In a forked child, drop the parent's pending counts (the parent writes them)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._hits, self._lookups, self._found, self._timer = {}, 0, 0, None

    def _note_access(self, digest: bytes | None = None, *, lookup: bool = False) -> None:
        """Count a ``lookup`` and/or a load of entry ``digest`` (a hit); a timer writes them."""
        with self._lock:
            self._adopt_after_fork()
            if digest is not None:
                self._hits[digest] = self._hits.get(digest, 0) + 1
                self._found += 1
            if lookup:
                self._lookups += 1
            if self._timer is not None or self._closed:
                return
            self._timer = timer = threading.Timer(ACCESS_FLUSH_SECONDS, self._timed_flush)
            timer.daemon = True
            timer.name = "kvstore-access-stamps"
        timer.start()

    def _timed_flush(self) -> None:
        with self._lock:
            self._timer = None
        self.flush_access()

    def close(self) -> None:
        """Write the pending access stamps and close the index (a second close does nothing)."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        with self._flush_lock:
            if self._closed:
                return
            self._write_access()
            self._closed = True
            self.index.close()
        atexit.unregister(self._exit_hook)

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
        toks = P.as_tokens(tokens)
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {sorted(PRIORITIES)}, got {priority!r}")
        if isinstance(cache, (str, bytes)) or not isinstance(cache, Sequence) or len(cache) == 0:
            raise CacheMismatchError("cache must be a non-empty list of cache objects")
        meta = dict(metadata or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise TypeError("metadata must map str to str")
        n = len(toks)
        tok_le = P.tokens_le(toks)
        T, algo = self.block_tokens, self.settings.hash
        keys = P.chain(self._c0(ns), tok_le, T, algo, n // T)
        xkey = P.exact_key_for(keys, tok_le, n, T, algo)
        with self.index.read() as txn:
            existing = self.index.find_exact(xkey, txn)
            rec = self.index.get_entry(existing, txn) if existing else None
        if existing and rec is not None:
            return EntryInfo(existing.hex(), n, rec.logical_bytes, 0, created=False)

        snaps = [snapshot(c) for c in cache]
        snaps += [_attachment_snapshot(a) for a in attachments]
        n_layers = len(cache)
        layers, blockset = place(snaps, n, self.block_tokens, self.settings.state_block_bytes)
        known = (
            self._reusable_prefix(toks, tok_le, keys, layers[:n_layers]) if reuse_prefix else []
        )
        new_bytes = write_blocks(self.blocks, blockset, known)
        can_trim = trimmable(layers[:n_layers])
        manifest = Manifest(
            namespace=ns,
            codec=CODEC_PROVIDER,
            hash=self.settings.hash,
            block_tokens=self.block_tokens,
            state_block_bytes=self.settings.state_block_bytes,
            created_at=now_ms() if created_at is None else created_at,
            n_tokens=n,
            tokens=tok_le,
            layers=layers[:n_layers],
            token_blocks=tuple(blockset.token_digests),
            state_blocks=tuple(blockset.state_digests),
            state_bytes=blockset.state_bytes,
            attachments=tuple(
                Attachment(schema=a.schema, metadata=a.metadata, tensors=layer.tensors)
                for a, layer in zip(attachments, layers[n_layers:], strict=True)
            ),
            metadata=meta,
        )
        encoded = encode_manifest(manifest)
        h = new_hasher(self.settings.hash)
        h.update(encoded)
        digest = h.digest()
        items = prefix_items(keys, toks, T, can_trim, digest)
        logical = blockset.logical_bytes()
        stamp = now_ms()
        pieces = blockset.by_digest()

        reused = set(known)

        def ensure(d: bytes) -> None:
            if not self.blocks.exists(d):
                if d in reused:  # its entry was deleted and collected meanwhile
                    raise _PrefixGone
                self.blocks.put(d, pieces[d])

        plan = SavePlan(
            digest=digest,
            manifest=encoded,
            blocks=blockset.sizes(),
            prefix_items=items,
            exact_key=xkey,
            entry=EntryRecord(
                namespace=_ns_json.encode(ns).decode(),
                n_tokens=n,
                logical_bytes=logical,
                created_at=manifest.created_at,
                last_access=stamp,
                priority=PRIORITIES[priority],
            ),
            ensure_block=ensure,
        )
        crash_point("before_commit")
        try:
            created = self.index.commit_save(plan)
        except _PrefixGone:  # the transaction was aborted: save our own bytes instead
            return self.save(
                toks,
                cache,
                namespace=ns,
                metadata=meta,
                priority=priority,
                attachments=attachments,
                created_at=manifest.created_at,
            )
        crash_point("after_commit")
        if created and self.max_bytes is not None:
            enforce_budget(self.parts, self.max_bytes, grace=self.gc_grace)
        if not created:  # a concurrent save of the same tokens won
            with self.index.read() as txn:
                existing = self.index.find_exact(xkey, txn)
            return EntryInfo(
                existing.hex() if existing else digest.hex(), n, logical, new_bytes, created=False
            )
        return EntryInfo(digest.hex(), n, logical, new_bytes)

    def _reusable_prefix(
        self,
        toks: Sequence[int],
        tok_le: bytes,
        keys: list[bytes],
        layers: tuple[Layer, ...],
    ) -> list[bytes]:
        """Digests of the leading full token blocks a stored entry holds for these tokens.

        Uses the chain ``keys`` the save already computed, and resolves the match
        and its manifest in one read transaction.
        """
        T = self.block_tokens
        with self.index.read() as txn:
            match = find(
                self.index, txn, keys, toks, tok_le, T, self.settings.hash, bisect=self._bisect
            )
            if match is None or match.length < T:
                return []
            raw = self.index.get_manifest(bytes.fromhex(match.entry_id), txn)
        if raw is None:
            return []
        m = decode_manifest(raw)
        if _token_layout(m.layers) != _token_layout(layers):
            return []
        return list(m.token_blocks[: match.length // T])

    # --- lookup ----------------------------------------------------------------------------

    def lookup(self, tokens: Any, *, namespace: Namespace | None = None) -> Match | None:
        """The longest usable stored prefix of ``tokens``, or None.

        Costs one hash per block of the query plus about log2(blocks) index
        seeks (a binary search over the chain), whatever the number of stored
        entries; a root without reach markers falls back to one seek per block.
        """
        match = self._find(tokens, namespace)
        self._note_access(lookup=True)
        return match

    def _find(self, tokens: Any, namespace: Namespace | None) -> Match | None:
        ns = self._ns(namespace)
        q = P.as_tokens(tokens)
        T = self.block_tokens
        q_le = P.tokens_le(q)
        depth = len(q) // T
        keys = P.chain(self._c0(ns), q_le, T, self.settings.hash, depth)
        with self.index.read() as txn:
            return find(self.index, txn, keys, q, q_le, T, self.settings.hash, bisect=self._bisect)

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
        ``match`` (the hit rate of ``kvstore stats``) and stamps the entry's last
        access. ``verify`` (None: the store's ``verify_reads``) checks each
        block's digest over the bytes read. A missing block raises
        :class:`BlockNotFoundError`; a corrupt one (the wrong digest, the wrong
        size, not a regular file) is quarantined, the entries that need it are
        cut back or dropped (see :mod:`kvstore.store.repair`), and
        :class:`CorruptBlockError` names it: a new lookup then finds the
        longest intact prefix.
        """
        digest = self._digest(match.entry_id)
        _, cache, _ = self._read(digest, match.length, verify)
        self._note_access(digest)
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
        """Read an entry (its first ``length`` tokens); a bad block is dealt with here.

        A block found bad is re-checked under the writer lock; if it reads right
        by then (another process replaced it) the read is tried once more.
        """
        verify = self.verify_reads if verify is None else verify
        for _ in range(2):
            try:
                return self._read_once(digest, length, verify)
            except _BadBlocks as e:
                if self._repair_bad(e.bad):
                    d = min(e.bad)
                    path, why = self.blocks.path(d), e.bad[d][0]
                    raise CorruptBlockError(
                        str(path), f"block {d.hex()}", why, digest=d.hex()
                    ) from None
        return self._read_once(digest, length, verify)

    def _read_once(
        self, digest: bytes, length: int | None, verify: bool
    ) -> tuple[Manifest, list[Any], list[AttachmentData]]:
        """Resolve an entry and open the blocks of its first ``length`` tokens in one
        read transaction (a GC cannot unlink them from under us), then restore."""
        fds: dict[bytes, int] = {}
        try:
            with self.index.read() as txn:
                raw = self.index.get_manifest(digest, txn)
                if raw is None:
                    raise EntryNotFoundError(f"no entry {digest.hex()}")
                m = decode_manifest(raw)
                length = m.n_tokens if length is None else length
                if not 0 < length <= m.n_tokens:
                    raise CacheMismatchError(f"cannot restore {length} of {m.n_tokens} tokens")
                specs = iter_tensor_specs(m.layers) + [t for a in m.attachments for t in a.tensors]
                tok_sizes, state_sizes = manifest_block_sizes(
                    specs, m.n_tokens, m.block_tokens, m.state_bytes, m.state_block_bytes
                )
                n_read = n_token_blocks(length, m.block_tokens) if m.token_blocks else 0
                needed = list(zip(m.token_blocks[:n_read], tok_sizes[:n_read], strict=True))
                needed += list(zip(m.state_blocks, state_sizes, strict=True))
                for d, size in needed:
                    if d in fds:
                        continue
                    try:
                        fds[d] = self.blocks.open(d, size)
                    except CorruptBlockError as e:
                        raise _BadBlocks({d: (e.actual, size)}) from None
            check = BlockCheck(self.settings.hash, needed, hashing=verify)
            cache, atts = self._materialize(m, length, fds, check)
            bad = check.bad()
            if bad:
                sizes = dict(needed)
                raise _BadBlocks({d: (why, sizes[d]) for d, why in bad.items()})
        finally:
            for fd in fds.values():
                os.close(fd)
        return m, cache, atts

    def _repair_bad(self, bad: dict[bytes, tuple[str, int]]) -> bool:
        """Quarantine the blocks a read found bad and cut back or drop the entries that
        need them (one write transaction, one warning); False when every block now
        reads right (it was replaced meanwhile: read again)."""
        try:
            with self.index.write() as txn:
                confirmed: dict[bytes, str] = {}
                gone: set[bytes] = set()
                for d, (why, size) in bad.items():
                    state, now, _ = self.blocks.inspect(d, size, read_data=True)
                    if state == "corrupt":
                        confirmed[d] = now or why
                    elif state == "missing":
                        gone.add(d)
                if not confirmed and not gone:
                    return False
                plan = plan_for_blocks(self.parts, txn, confirmed, gone)
                plan.execute(self.parts, txn)
        except (KVStoreError, OSError) as e:
            names = ", ".join(f"{d.hex()} ({why})" for d, (why, _) in sorted(bad.items()))
            _log.warning("kvstore: corrupt block %s could not be quarantined: %s", names, e)
            return True
        if not plan.empty():
            _log.warning("%s", plan.summary())
        return True

    def _materialize(
        self, m: Manifest, length: int, fds: dict[bytes, int], check: BlockCheck
    ) -> tuple[list[Any], list[AttachmentData]]:
        wants: list[Want] = []
        for layer in _leaves(m.layers):
            codec = codec_for_record(layer)
            for spec in layer.tensors:
                cap = codec.token_capacity(layer, length) if spec.token_axis is not None else None
                wants.append(Want(spec, cap))
        for a in m.attachments:
            wants.extend(Want(t) for t in a.tensors)
        n_read = n_token_blocks(length, m.block_tokens) if m.token_blocks else 0
        shapes, plans = plan_runs(
            wants,
            n_tokens=m.n_tokens,
            length=length,
            block_tokens=m.block_tokens,
            token_fds=[fds[d] for d in m.token_blocks[:n_read]],
            state_fds=[fds[d] for d in m.state_blocks],
            state_block=m.state_block_bytes,
        )
        arrays = load_arrays(shapes, plans, check)
        out: list[Any] = []
        pos = 0
        for layer in m.layers:
            count = len(iter_tensor_specs((layer,)))
            codec = codec_for_record(layer)
            drop = m.n_tokens - length
            out.append(codec.load(layer, arrays[pos : pos + count], length, drop=drop))
            pos += count
        atts = []
        for a in m.attachments:
            atts.append(
                AttachmentData(a.schema, a.metadata, tuple(arrays[pos : pos + len(a.tensors)]))
            )
            pos += len(a.tensors)
        return out, atts

    def import_file(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        namespace: Namespace | None = None,
    ) -> EntryInfo:
        """Store an mlx-bun v3/v4/v5 file as one entry.

        The whole file is read (and, with ``verify``, every tensor or v5 block hash
        checked) before anything is written, so a malformed file raises its
        :class:`~kvstore.errors.FileFormatError` and leaves the store unchanged.
        The entry's namespace is ``namespace``, else the header's identity, else
        the store's default (:class:`NamespaceRequiredError` when there is none).
        """
        self._check_writable("import")
        f = read_file(path, verify=verify)
        return self.save(
            f.tokens,
            f.cache,
            namespace=namespace or f.namespace,
            metadata=f.metadata,
            attachments=f.attachments,
            priority=f.priority,
            created_at=f.created_at,
        )

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
        return write_file(m, tokens, cache, attachments, path, format=format)

    def restore(
        self, tokens: Any, *, namespace: Namespace | None = None, verify: bool | None = None
    ) -> tuple[list[Any] | None, int]:
        """Lookup and load: ``(cache, length)`` of the longest intact stored prefix, or
        ``(None, 0)``.

        Never raises for what it finds on disk: a corrupt block is quarantined (see
        :meth:`load`) and the lookup is made again, so the caller gets the longest
        prefix still stored intact; a block or entry removed meanwhile (evicted by
        another process) is looked up again too.
        """
        cache: list[Any] | None = None
        length = 0
        tried: set[tuple[str, int]] = set()
        self._note_access(lookup=True)  # one lookup, however many tries it takes
        for _ in range(_RESTORE_TRIES):
            match = self._find(tokens, namespace)
            if match is None or (match.entry_id, match.length) in tried:
                break
            tried.add((match.entry_id, match.length))
            try:
                cache, length = self.load(match, verify=verify), match.length
                break
            except (BlockNotFoundError, CorruptBlockError, EntryNotFoundError, ManifestError):
                continue
        return (cache, length) if cache is not None else (None, 0)

    # --- entries -------------------------------------------------------------------------------

    def resolve(self, entry_id: str) -> str:
        """A full entry id from a unique prefix of at least ``MIN_ID_PREFIX`` (4) hex chars."""
        s = entry_id.strip().lower()
        if len(s) == 64:
            self._digest(s)
            return s
        if any(c not in "0123456789abcdef" for c in s) or not s:
            raise EntryNotFoundError(f"not an entry id or prefix: {entry_id!r}")
        if len(s) < MIN_ID_PREFIX:
            raise EntryNotFoundError(
                f"entry id prefix {entry_id!r} is too short: "
                f"give at least {MIN_ID_PREFIX} hex chars"
            )
        hits = [e.id for e in self.entries() if e.id.startswith(s)]
        if not hits:
            raise EntryNotFoundError(f"no entry matches {entry_id!r}")
        if len(hits) > 1:
            raise EntryNotFoundError(f"{len(hits)} entries match {entry_id!r}: give more hex chars")
        return hits[0]

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
        for digest, rec in rows:
            ns = _ns_dec.decode(rec.namespace)
            if namespace is not None and ns != namespace:
                continue
            yield Entry(
                id=digest.hex(),
                namespace=ns,
                n_tokens=rec.n_tokens,
                logical_bytes=rec.logical_bytes,
                created_at=rec.created_at,
                last_access=rec.last_access,
                hits=rec.hits,
                priority=_PRIORITY_NAMES.get(rec.priority, "assistant"),
            )

    def compact(
        self,
        *,
        max_bytes: int | None = None,
        namespace_max_bytes: int | None = None,
        grace: float = 600.0,
        dry_run: bool = False,
    ) -> CompactReport:
        """Evict above the byte budgets, delete expired garbage (:func:`.gc.compact`)."""
        if not dry_run:
            self._check_writable("compact")
        self.flush_access()
        return compact(
            self.parts,
            max_bytes=max_bytes,
            namespace_max_bytes=namespace_max_bytes,
            grace=grace,
            dry_run=dry_run,
        )

    def verify(
        self, *, read_data: bool = False, repair: bool = False, dry_run: bool = False
    ) -> VerifyReport:
        """Check refcounts, blocks and keys (and, with ``read_data``, every block's
        bytes); ``repair`` fixes what it finds, ``dry_run`` only says how. See
        :func:`kvstore.verify.verify`."""
        if repair:
            self._check_writable("repair")
        self.flush_access()
        return verify(self.parts, read_data=read_data, repair=repair, dry_run=dry_run)

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


class _PrefixGone(Exception):
    """A reused prefix block vanished before the commit (its entry was collected)."""


def _exit_flush(store: Store) -> Callable[[], None]:
    """An exit hook that writes ``store``'s pending stamps; it does not keep the store alive."""
    ref = weakref.ref(store)

    def hook() -> None:
        s = ref()
        if s is not None:
            s.flush_access()

    return hook


class _BadBlocks(Exception):
    """Blocks a read found bad: digest -> (what is wrong, expected size)."""

    def __init__(self, bad: dict[bytes, tuple[str, int]]) -> None:
        super().__init__(", ".join(d.hex() for d in bad))
        self.bad = bad


def _has_reach_markers(index: Index, *, writable: bool = True) -> bool:
    """Whether lookups may bisect: the root's non-trimmable entries all have reach markers.

    A root from before reach markers gets them here, once; if it cannot be
    written, its lookups walk every depth instead (slower, same answers).
    """
    if index.get_meta(REACH_META) is not None:
        return True
    if not writable:
        return False
    try:
        n = add_reach_markers(index)
    except KVStoreError as e:
        _log.warning("kvstore: lookups will not bisect: %s", e)
        return False
    if n:
        _log.info("kvstore: added reach markers for %d non-trimmable entries", n)
    return True


def _token_layout(layers: Sequence[Layer]) -> list[tuple[str, int, tuple[int, ...]]]:
    """What fixes a token block's bytes per token: each token tensor's dtype and other dims."""
    return [
        (s.dtype, s.token_axis, s.shape[: s.token_axis] + s.shape[s.token_axis + 1 :])
        for s in iter_tensor_specs(tuple(layers))
        if s.token_axis is not None
    ]


def _attachment_snapshot(a: AttachmentData) -> Any:
    """Attachments are stored like a raw layer: state tensors, kept whole."""
    return snapshot(RawCache(source_kind=f"attachment:{a.schema}", tensors=list(a.tensors)))


__all__ = ["Entry", "EntryInfo", "Match", "Stats", "Store", "TensorSpec", "default_root"]
