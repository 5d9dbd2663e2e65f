"""mlx-lm integration: a persistent drop-in for ``mlx_lm``'s ``LRUPromptCache``.

`PersistentPromptCache` keeps mlx-lm's in-memory LRU tier and puts the disk
store behind it. A fetch that the memory tier cannot answer in full falls
through to the store; an insert goes to memory at once and to disk from a
background thread (write-behind), so a request never waits on the disk.

Each ``model_key`` (mlx-lm's server passes ``(model_path, adapter_path,
draft_model_path)``) maps to a store `Namespace` whose fingerprint covers the
model's config and weights (and the adapter's and draft model's), so two models
never exchange caches and a changed model never gets a stale one.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import hashlib
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from mlx_lm.models import cache as _cache

from kvstore import Namespace, Store
from kvstore.store.tenants import salt_tag, tenant_key, tenant_namespace
from kvstore.store.usage import Counts, failure_reason

from ..codecs.staging import setup_seconds
from .cache_control import parse_pin_type
from .crossover import Throughputs, cache_nbytes, measure_copy
from .fingerprint import fingerprint_model, fingerprint_model_dir, namespace_for_path
from .prefill import CHECKPOINT, parse_checkpoint_type
from .requests import (
    EXCERPT_CHARS,
    CacheObserver,
    Parting,
    RequestContext,
    RequestRecord,
    RequestTracker,
)
from .writebehind import (
    DEFAULT_DEFER_SECONDS,
    SaveDone,
    WriteBehind,
    cached_tokens,
    register_exit_flush,
)

__all__ = [
    "PersistStats",
    "PersistentPromptCache",
    "TenantKey",
    "fingerprint_model",
    "fingerprint_model_dir",
    "namespace_for_path",
]

logger = logging.getLogger("kvstore.mlx_lm")


class TenantKey(NamedTuple):
    """A model key of one tenant: ``tag`` names its salt (a keyed hash of it, see
    :mod:`kvstore.store.tenants`). Its entries, in memory and in the store, are its own."""

    model_key: Hashable
    tag: str


@dataclass
class _Pin:
    """A cache breakpoint's cache, held in memory beside mlx-lm's LRU until ``ttl`` seconds
    have passed since ``used``."""

    model_key: Hashable
    tokens: list[int]
    cache: list[Any]
    nbytes: int
    ttl: float
    cache_type: str
    used: float


@dataclass(frozen=True)
class PersistStats:
    """Counters of the disk tier (a snapshot; all counts since construction)."""

    pending: int
    pending_bytes: int
    saved: int
    dropped: int
    failed: int
    skipped: int
    bytes_written: int
    logical_bytes_saved: int
    memory_hits: int
    store_hits: int
    misses: int
    tokens_from_store: int
    deferred: int = 0  # snapshots waiting in memory (see kvstore.mlx_lm.writebehind)
    deferred_bytes: int = 0
    superseded: int = 0  # deferred snapshots replaced by a later one of their conversation
    kv_bytes_added: int = 0  # the saves' logical bytes beyond what the root held before each
    recomputed: int = 0  # store or memory hits computed instead (miss recompute_faster)

    @property
    def write_amplification(self) -> float | None:
        """Bytes written over the KV bytes they added to the root (None before a save)."""
        return self.bytes_written / self.kv_bytes_added if self.kv_bytes_added else None

    def summary(self) -> str:
        """One line for a log: ``saved 3 entries (… new of …), 5 hits (…), …``."""
        text = (
            f"saved {self.saved} {'entry' if self.saved == 1 else 'entries'} "
            f"({_mib(self.bytes_written)} new of {_mib(self.logical_bytes_saved)}); "
            f"{self.store_hits} {'hit' if self.store_hits == 1 else 'hits'} from the store "
            f"({self.tokens_from_store:,} tokens), {self.memory_hits} from memory, "
            f"{self.misses} {'miss' if self.misses == 1 else 'misses'}"
        )
        lost = [
            f"{n} {what}"
            for n, what in (
                (self.pending, "not written"),
                (self.dropped, "dropped"),
                (self.failed, "failed"),
            )
            if n
        ]
        return text + (f"; snapshots {', '.join(lost)}" if lost else "")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class PersistentPromptCache:
    """mlx-lm's `LRUPromptCache` with a persistent, shared disk store behind it.

    Same methods and meaning as ``mlx_lm.models.cache.LRUPromptCache``;
    ``insert_cache`` takes ownership of the cache it is given (as mlx-lm's does)
    and also queues it for the store. Prompts shorter than `min_tokens` stay in
    memory only; queued snapshots above `queue_bytes` are shed oldest first.
    The disk budget is the store's (``Store.open(max_bytes=...)``).

    With `reuse_prefix` (the default) each save references the blocks a stored
    entry already holds for its leading tokens instead of hashing them again
    (``Store.save(reuse_prefix=True)``): the next turn of a conversation was
    extended from the cache this store gave or took, so those rows are the same
    bytes. If another process stored the same prefix from its own prefill, the
    entry gets that process's rows for it: the same tokens' state, possibly
    different in the last bits. Pass False to hash every block of every save.

    A snapshot that would only rewrite the partial last block of what the store holds
    for its leading tokens waits in memory for up to `defer_seconds` and is replaced by
    its conversation's next one (:mod:`kvstore.mlx_lm.writebehind` says why); ``0``
    writes every snapshot at once. Each fetch counts one request in the root's
    per-tier counts (``kvstore stats``); `observers` hear of each request and save
    (:class:`~kvstore.mlx_lm.requests.CacheObserver`).

    Tenants: after :meth:`set_tenant` (``kvstore serve`` calls it with each request's
    ``cache_salt``) the fetches and inserts that follow use that salt's own entries,
    in memory and in the store, until the next call; see :class:`TenantKey`.

    With `remote_deadline` (seconds; None: the store's, ``Store.open(remote_deadline=...)``)
    a fetch waits for the store's remote tier, lookup and pull together, at most that
    long: what is not pulled by then is computed (the local match or nothing) and its pull
    goes on in the background, so the next request with that prefix restores it locally.
    It is this cache's own (each lookup passes it): another cache of the same store keeps
    its own, and the store's is unchanged.

    Cache breakpoints (:mod:`kvstore.mlx_lm.cache_control`: ``kvstore serve`` cuts a
    request's prompt at each one and inserts the cache there with a pinned segment type)
    are held in memory beside the LRU, out of its reach, until their TTL has passed since
    their last use (by ``clock``, seconds), and saved to the store pinned for the same TTL.
    At most half the LRU's entries and half its bytes are pinned: beyond that, and when its
    TTL has passed, the least recently used pin is handed to the LRU as an ordinary entry.

    A stored prefix is restored only when that is predicted faster than computing it,
    from the restore and prefill rates this process measured (`throughputs`,
    :mod:`kvstore.mlx_lm.crossover`); otherwise the request computes it and its miss
    reason is ``recompute_faster``.
    """

    def __init__(
        self,
        store: Store,
        *,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        min_tokens: int = 256,
        queue_bytes: int = 1 << 30,
        ns: str = "default",
        exit_timeout: float | None = 60.0,
        reuse_prefix: bool = True,
        defer_seconds: float = DEFAULT_DEFER_SECONDS,
        remote_deadline: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if remote_deadline is not None:
            if not remote_deadline > 0:  # NaN too
                raise ValueError(f"remote_deadline must be > 0, got {remote_deadline}")
        self.store = store
        #: Seconds a fetch waits for the remote tier (None: the store's deadline).
        self.remote_deadline = remote_deadline
        self.reuse_prefix = reuse_prefix
        self.min_tokens = min_tokens
        self.queue_bytes = queue_bytes
        self.defer_seconds = defer_seconds
        self.ns = ns
        self.observers: list[CacheObserver] = []
        self._memory = _cache.LRUPromptCache(max_size=max_size, max_bytes=max_bytes)
        self.clock = clock
        self._pins: OrderedDict[tuple[Hashable, tuple[int, ...]], _Pin] = OrderedDict()
        self._marks: dict[int, float] = {}  # the next request's breakpoints: position -> TTL
        self._namespaces: dict[Hashable, Namespace | None] = {}
        self._tag: str | None = None  # of the current tenant's salt; None: no salt
        self._salt_key: bytes | None = None
        self._lock = threading.Lock()  # guards the counters below
        self._counts: dict[str, int] = {}
        self._usage = Counts()  # this process's requests, by tier
        self.throughputs = Throughputs()  # restore and prefill rates (issue 37)
        self._memory_recomputed = False  # the current fetch's memory hit was computed instead
        self._prefill_marks: dict[int, tuple[float, int]] = {}  # request id -> (when, tokens)
        self._writer = WriteBehind(store, queue_bytes=queue_bytes, reuse_prefix=reuse_prefix,
                                   defer_seconds=defer_seconds, on_save=self._saved)
        self._requests = RequestTracker(self._finished)
        self._context: RequestContext | None = None  # of the next fetch (set_request)
        #: The record the last fetch opened (its caller's thread is the only fetcher).
        self.last_record: RequestRecord | None = None
        ref = weakref.ref(self)

        def _flush_at_exit() -> None:
            obj = ref()
            if obj is not None:
                obj.close(timeout=exit_timeout)

        self._atexit: Callable[[], None] = _flush_at_exit
        register_exit_flush(_flush_at_exit)

    # --- LRUPromptCache's interface -------------------------------------------

    @property
    def max_size(self) -> int:
        """Most entries held in memory."""
        return int(self._memory.max_size)

    @property
    def max_bytes(self) -> int:
        """Most bytes held in memory."""
        return int(self._memory.max_bytes)

    def __len__(self) -> int:
        return len(self._memory) + len(self._pins)

    @property
    def nbytes(self) -> int:
        """Bytes held by the memory tier (its pins too)."""
        return int(self._memory.nbytes) + sum(p.nbytes for p in list(self._pins.values()))

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        """Memory-tier entries and bytes per cache type, as mlx-lm reports them."""
        return dict(self._memory.stats_by_type())  # type: ignore[no-untyped-call]

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Evict memory-tier entries down to the limits (the disk tier is not touched)."""
        self._memory.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

    def fetch_nearest_cache(
        self, model_key: Hashable, tokens: list[int]
    ) -> tuple[list[Any] | None, list[int]]:
        """Return ``(cache, rest)``: a private cache of the longest known prefix of
        `tokens` and the tokens still to process (``(None, tokens)`` on a miss).

        Counts one request: its prompt tokens, the tier that gave the reused ones (the
        whole ``len(tokens) - len(rest)``, which mlx-lm's server reports as
        ``cached_tokens``) and, when it reused nothing or less than it might have, why.
        """
        t0 = time.perf_counter()
        self._memory_recomputed = False
        context, self._context = self._context, None
        model_key = self._tenant(model_key)
        self._expire_pins()
        cache, rest = self._memory.fetch_nearest_cache(model_key, tokens)
        have = len(tokens) - len(rest) if cache is not None else 0
        pinned = self._fetch_pinned(model_key, tokens, have)
        if pinned is not None:
            cache, rest = pinned
            have = len(tokens) - len(rest)
        elif cache is not None and have > 0 and self._copy_dearer(cache, have):
            cache, rest, have = None, list(tokens), 0  # computed instead (a hit never dearer)
        tier, miss, waiting = ("memory" if have else None), None, 0
        if cache is None or rest:
            # A snapshot still waiting to be written (a checkpoint the writer has not
            # reached) is looked at before the store: one the writer commits meanwhile
            # is then seen by one of the two. So is how much of the prompt the waiting
            # snapshots share, for the miss reason.
            waiting = self._waiting_shared(model_key, tokens)
            pending = self._fetch_pending(model_key, tokens, have)
            if pending is not None:
                cache, rest = pending
                have, tier = len(tokens) - len(rest), "memory"
            found, where, miss = self._fetch_from_store(model_key, tokens, have)
            if found is None and cache is None and self._memory_recomputed:
                miss = "recompute_faster"
            if found is not None:
                (cache, rest), tier = found, where
                self._count("store_hits")
                self._count("tokens_from_store", len(tokens) - len(rest))
            else:
                self._count("memory_hits" if cache is not None else "misses")
        else:
            self._count("memory_hits")
        reused = len(tokens) - len(rest) if cache is not None else 0
        miss = self._shallow_if_waiting(miss, waiting, reused)
        self._use_breakpoints(model_key, tokens, reused)
        namespace = self.namespace_for(model_key)
        rec = RequestRecord(self._requests.next_id(),
                            namespace.model_id if namespace is not None else "-",
                            len(tokens), tier if reused else None, reused,
                            time.perf_counter() - t0, miss, prompt=list(tokens))
        if context is not None:
            rec.rewrites = dict(context.rewrites)
        rec.shared = reused
        if len(tokens) - reused > 1:
            self._parting(rec, model_key, namespace, tokens, context)
        with self._lock:
            self._usage.note(rec.prompt_tokens, reused, rec.tier, miss)
        try:
            self.store.note_request(rec.prompt_tokens, reused, rec.tier, miss=miss)
        except Exception:  # noqa: BLE001 - counting never fails a request
            logger.warning("kvstore: request not counted", exc_info=True)
        self._requests.opened(rec)
        self.last_record = rec
        self._notify("fetched", rec)
        return cache, rest

    def insert_cache(
        self,
        model_key: Hashable,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        """Keep `prompt_cache` for `tokens` in memory and queue it for the store.

        A checkpoint (``cache_type`` ``"checkpoint"``, or the segment type that
        ``kvstore serve`` gives its cuts) goes to the store only: mlx-lm's LRU keeps
        every prefix of a cache that cannot be trimmed, so checkpoints there would
        hold O(n^2) bytes for a long prompt. At most one checkpoint waits in the
        write-behind queue; the next one waits for the writer to take it.
        """
        model_key = self._tenant(model_key)
        pin = parse_pin_type(cache_type)
        if pin is not None:  # a cache breakpoint: pinned, in memory and in the store
            ttl, base = pin
            self._pin(model_key, tokens, prompt_cache, ttl, base)
            rec, _ = self._requests.owner(tokens)
            outcome = self._enqueue(model_key, tokens, prompt_cache, base, len(tokens),
                                    pin_ttl=ttl)
            self._requests.inserted(rec, False, outcome)
            return
        checkpoint = parse_checkpoint_type(cache_type)
        if checkpoint is not None:  # a cut inside a request's prompt: one of its saves
            rec, _ = self._requests.owner(tokens)
            self._note_prefill(rec, len(tokens))
            outcome = self._enqueue(model_key, tokens, prompt_cache, CHECKPOINT, len(tokens),
                                    metadata=checkpoint)
            self._requests.inserted(rec, False, outcome)
            return
        self._memory.insert_cache(model_key, tokens, prompt_cache, cache_type=cache_type)
        rec, reply = self._requests.owner(tokens)
        if reply:
            with self._lock:
                self._prefill_marks.pop(rec.id if rec is not None else -1, None)
        else:
            self._note_prefill(rec, len(tokens))
        # a reply's snapshot belongs to the conversation of every later one that starts
        # with its prompt (the next turn re-renders the reply's own tokens)
        stem = rec.prompt_tokens if rec is not None and reply else len(tokens)
        outcome = self._enqueue(model_key, tokens, prompt_cache, cache_type, stem)
        self._requests.inserted(rec, reply, outcome)

    # --- cache breakpoints ---------------------------------------------------------

    def set_breakpoints(self, marks: Mapping[int, float]) -> None:
        """The next request's cache breakpoints: token position -> TTL (seconds). Its fetch
        counts a use of each one it reuses (the memory pin's and the store entry's TTL run
        from then); ``kvstore serve`` calls this before each fetch."""
        self._marks = dict(marks)

    def _pin(self, model_key: Hashable, tokens: list[int], prompt_cache: list[Any],
             ttl: float, cache_type: str) -> None:
        key = (model_key, tuple(tokens))
        self._pins[key] = _Pin(model_key, list(tokens), prompt_cache,
                               sum(int(c.nbytes) for c in prompt_cache), ttl, cache_type,
                               self.clock())
        self._pins.move_to_end(key)
        self._expire_pins()

    def _expire_pins(self) -> None:
        """Hand the pins whose TTL has passed, and the least recently used ones beyond half
        the LRU's entries or bytes, to the LRU as ordinary entries."""
        now = self.clock()
        for key in [k for k, p in self._pins.items() if now - p.used >= p.ttl]:
            self._release(key)
        most = max(1, self.max_size // 2)
        while self._pins and (len(self._pins) > most
                              or sum(p.nbytes for p in self._pins.values()) > self.max_bytes // 2):
            self._release(next(iter(self._pins)))

    def _release(self, key: tuple[Hashable, tuple[int, ...]]) -> None:
        pin = self._pins.pop(key)
        self._memory.insert_cache(pin.model_key, pin.tokens, pin.cache,
                                  cache_type=pin.cache_type)

    def _fetch_pinned(self, model_key: Hashable, tokens: list[int], have: int
                      ) -> tuple[list[Any], list[int]] | None:
        """A copy of the longest pin that is a prefix of ``tokens[:-1]`` longer than
        ``have``, and the tokens after it (a use of the pin)."""
        best: _Pin | None = None
        for (mk, _), pin in self._pins.items():
            n = len(pin.tokens)
            if mk == model_key and have < n < len(tokens) \
                    and (best is None or n > len(best.tokens)) and tokens[:n] == pin.tokens:
                best = pin
        if best is None:
            return None
        n = len(best.tokens)
        return copy.deepcopy(best.cache), list(tokens[n:])

    def _use_breakpoints(self, model_key: Hashable, tokens: list[int], reused: int) -> None:
        """Count a use of each pin that ``reused`` covers: the request's own breakpoints (in
        memory and in the store), and any memory pin that is a prefix of its prompt."""
        marks, self._marks = self._marks, {}
        now = self.clock()
        for (mk, _), pin in list(self._pins.items()):
            n = len(pin.tokens)
            if mk == model_key and n <= reused and tokens[:n] == pin.tokens:
                pin.used = now
                self._pins.move_to_end((mk, tuple(pin.tokens)))
        namespace = self.namespace_for(model_key) if marks else None
        for n in sorted(marks):
            if n <= reused and namespace is not None:
                try:
                    self.store.touch(tokens[:n], namespace=namespace)
                except Exception:  # noqa: BLE001 - a stamp never fails a request
                    logger.warning("kvstore: breakpoint use not recorded", exc_info=True)

    # --- what the server knows of a request -------------------------------------------

    def end_request(self, rec: RequestRecord, outcome: str) -> None:
        """Finish the record of a request that will insert no reply (it was cancelled or
        failed before one): its line is logged now, ``reply=none outcome=…``. A record
        finished already is left alone."""
        if rec.outcome is None:
            rec.outcome = outcome
        self._requests.close(rec)

    def set_request(self, context: RequestContext | None) -> None:
        """What the server knows of the request whose lookup comes next (``kvstore serve``
        calls it from mlx-lm's tokenize, just before the lookup, in the same thread):
        the rewrites that fired and how to place a token among its messages, for its log
        line. The next :meth:`fetch_nearest_cache` takes it."""
        self._context = context

    def _parting(self, rec: RequestRecord, model_key: Hashable, namespace: Namespace | None,
                 tokens: list[int], context: RequestContext | None) -> None:
        """Set ``rec.shared`` (the leading tokens the deepest stored sequence of any tier
        shares with the prompt) and, when that sequence goes on with another token there,
        ``rec.parting``. Never fails a request."""
        try:
            shared, theirs = self._memory_parting(model_key, tokens)
            if namespace is not None:
                n, t = self.store.parting(tokens, namespace=namespace)
                if n > shared or (n == shared and theirs is None):
                    shared, theirs = n, t
            if rec.reused_tokens > shared:
                shared, theirs = rec.reused_tokens, None
            rec.shared = shared
            if not theirs:
                return
            rec.parting = Parting(shared)
            if context is None or (context.locate is None and context.decode is None):
                return

            def place() -> Parting:  # after the request: it renders the chat template
                where: tuple[int | None, str, str, int | None] = (None, "-", "-", None)
                ours = their_text = None
                if context.locate is not None:
                    where = context.locate(tokens, shared)
                if context.decode is not None:
                    ours = context.decode(tokens[shared: shared + len(theirs)])[:EXCERPT_CHARS]
                    their_text = context.decode(theirs)[:EXCERPT_CHARS]
                return Parting(shared, *where, ours=ours, theirs=their_text)

            rec.place = place
        except Exception:  # noqa: BLE001 - a diagnosis never fails a request
            logger.warning("kvstore: the parting of a request was not found", exc_info=True)

    def _memory_parting(self, model_key: Hashable, tokens: list[int]
                        ) -> tuple[int, list[int] | None]:
        """The memory tier's side of :meth:`_parting`: how far the prompt follows mlx-lm's
        token trie, and the stored tokens after that when a sequence goes on there."""
        node = getattr(getattr(self._memory, "_trie", None), "_trie", {}).get(model_key)
        if node is None:
            return 0, None
        i = 0
        while i < len(tokens) and tokens[i] in node:
            node = node[tokens[i]]
            i += 1
        theirs: list[int] = []
        while i < len(tokens) and len(theirs) < 16:
            nxt = next((k for k in node if k != "__value__"), None)
            if nxt is None:
                break
            theirs.append(nxt)
            node = node[nxt]
        return i, theirs or None

    # --- tenants ---------------------------------------------------------------

    def set_tenant(self, salt: str | None) -> None:
        """The salt of the requests that follow (None: none). Different salts never share
        an entry; the salt itself is kept nowhere, only a keyed hash of it. A salt that is
        empty or over 4 KiB is a :class:`~kvstore.KVStoreError`."""
        if salt is None:
            self._tag = None
            return
        if self._salt_key is None:
            self._salt_key = tenant_key(self.store)
        self._tag = salt_tag(self._salt_key, salt)

    def _tenant(self, model_key: Hashable) -> Hashable:
        if self._tag is None or isinstance(model_key, TenantKey):
            return model_key
        return TenantKey(model_key, self._tag)

    # --- models ----------------------------------------------------------------

    def register_model(
        self,
        model_key: Hashable,
        model: Any = None,
        model_path: str | Path | None = None,
        *,
        model_id: str | None = None,
    ) -> Namespace:
        """Tie `model_key` to the store namespace of a model directory and/or object.

        With `model_path` the fingerprint comes from its files; with `model` alone
        from its parameters (names, shapes, dtypes, sampled values).
        """
        if model_path is None and model is None:
            raise ValueError("register_model needs a model, a model_path or both")
        if model_path is not None:
            namespace = namespace_for_path(model_path, ns=self.ns)
            if model is not None:
                fp = hashlib.sha256(
                    f"{namespace.config_fingerprint}\0{fingerprint_model(model)}".encode()
                ).hexdigest()
                namespace = Namespace(
                    model_id=namespace.model_id,
                    config_fingerprint=fp,
                    tokenizer_hash=namespace.tokenizer_hash,
                    ns=self.ns,
                )
        else:
            namespace = Namespace(
                model_id=model_id or type(model).__module__,
                config_fingerprint=fingerprint_model(model),
                tokenizer_hash="",
                ns=self.ns,
            )
        if model_id is not None:
            namespace = Namespace(
                model_id=model_id,
                config_fingerprint=namespace.config_fingerprint,
                tokenizer_hash=namespace.tokenizer_hash,
                ns=self.ns,
            )
        self._namespaces[model_key] = namespace
        return namespace

    def namespace_for(self, model_key: Hashable) -> Namespace | None:
        """The store namespace of `model_key`; None when it cannot be fingerprinted.

        A key that was not registered is derived when it is a model path or
        mlx-lm's ``(model_path, adapter_path, draft_model_path)`` tuple; any other
        key stays memory-only (a warning is logged once).
        """
        if isinstance(model_key, TenantKey):  # not kept: a server may see many salts
            base = self.namespace_for(model_key.model_key)
            return None if base is None else tenant_namespace(base, model_key.tag)
        if model_key in self._namespaces:
            return self._namespaces[model_key]
        parts: tuple[Any, ...] = model_key if isinstance(model_key, tuple) else (model_key,)
        namespace: Namespace | None
        try:
            if not parts or len(parts) > 3:
                raise FileNotFoundError(f"{model_key!r} is not (model, adapter, draft)")
            namespace = namespace_for_path(*parts, ns=self.ns)
        except (FileNotFoundError, TypeError) as e:
            logger.warning("kvstore: model key %r stays in memory only: %s", model_key, e)
            namespace = None
        self._namespaces[model_key] = namespace
        return namespace

    # --- the disk tier ------------------------------------------------------------

    def _fetch_from_store(
        self, model_key: Hashable, tokens: list[int], have: int
    ) -> tuple[tuple[list[Any], list[int]] | None, str | None, str | None]:
        """``(found, tier, miss)``: the store's cache and rest when it holds more than
        `have` tokens, the tier it came from, and else why not."""
        # Look up all but the last token: like mlx-lm, leave at least one to process.
        if len(tokens) - 1 <= max(have, 0):
            return None, None, "too_short" if have <= 0 else None
        namespace = self.namespace_for(model_key)
        if namespace is None:  # a key kept in memory only: the store holds nothing of it
            return None, None, "no_entry" if have <= 0 else None
        query = tokens[:-1]
        try:
            match = self.store.lookup(query, namespace=namespace,
                                      deadline=self.remote_deadline)
            if match is None or match.length <= have:
                return None, None, self.store.miss_reason(query, namespace=namespace,
                                                          reused=have)
            # restore only what is predicted faster than computing it (issue 37)
            pred = self.throughputs.predict(match.where, namespace, match.length,
                                            match.length - max(have, 0))
            if pred is not None and pred.recompute and self.throughputs.skip():
                self._count("recomputed")
                return None, None, "recompute_faster"
            setup_seconds()  # from here on: this restore's own one-time costs
            t = time.perf_counter()
            cache = self.store.load(match)
            # a usable match may still be shorter than what the store shares with the
            # prompt (a checkpoint before the parting): say why (``shallow``); nothing
            # else is a reason for a hit (a remote that was slow to answer held no more
            # that anyone knows of: its own counters say it was slow)
            why = None
            if match.length < len(query):
                why = self.store.miss_reason(query, namespace=namespace, reused=match.length)
                why = why if why == "shallow" else None
            self.throughputs.note_restore(match.where, namespace, cache_nbytes(cache),
                                          match.length,
                                          time.perf_counter() - t - setup_seconds())
        except Exception as e:
            logger.warning("kvstore: store read failed; treating it as a miss", exc_info=True)
            return None, None, failure_reason(e)
        return (list(cache), list(tokens[match.length :])), match.origin or match.where, why

    def _waiting_shared(self, model_key: Hashable, tokens: list[int]) -> int:
        """How many leading tokens of the query (``tokens[:-1]``, as the store is asked) a
        snapshot still waiting to be written holds (0 for a key never queued)."""
        if model_key not in self._namespaces and not isinstance(model_key, TenantKey):
            return 0
        namespace = self.namespace_for(model_key)
        return 0 if namespace is None else self._writer.shared(namespace, tokens[:-1])

    def _shallow_if_waiting(self, miss: str | None, waiting: int, reused: int) -> str | None:
        """The store's miss reason, or ``shallow`` when a snapshot still waiting to be written
        shares more whole blocks of the query than the request reused: what the store says
        once the writer has saved it, so the reason does not depend on how far the writer
        has got. (A waiting snapshot that could serve more is served by the queue.)"""
        T = self.store.block_tokens
        if miss in (None, "no_entry", "other_model") and waiting // T * T > reused:
            return "shallow"
        return miss

    def _copy_dearer(self, cache: list[Any], reused: int) -> bool:
        """Whether a memory hit reusing ``reused`` tokens is predicted dearer than their
        prefill: the cache it hands out shares the whole entry's arrays, so its first step
        copies all of them (``cache_nbytes``), however few tokens it reuses. Counted and
        noted for the request's miss reason when so (one in ``PROBE_EVERY`` is used anyway)."""
        nbytes = cache_nbytes(cache)
        tp = self.throughputs
        if tp.copy_bps is None and tp.prefill_tps is not None:
            tp.note_copy(*measure_copy(nbytes))  # once a process: the device's copy rate
        pred = tp.predict_copy(nbytes, reused)
        if pred is None or not pred.recompute or not tp.skip():
            return False
        self._count("recomputed")
        self._memory_recomputed = True
        return True

    def _note_prefill(self, rec: RequestRecord | None, n: int) -> None:
        """A snapshot of a request's first ``n`` prompt tokens: the tokens computed since its
        fetch (or its previous snapshot) over the time it took, for the prefill rate."""
        if rec is None:
            return
        now = time.monotonic()
        with self._lock:
            when, done = self._prefill_marks.get(rec.id, (rec.started, rec.reused_tokens))
            if n <= done:
                return
            self._prefill_marks[rec.id] = (now, n)
            while len(self._prefill_marks) > 256:  # requests that never replied
                self._prefill_marks.pop(next(iter(self._prefill_marks)))
        self.throughputs.note_prefill(n - done, now - when)

    def _fetch_pending(
        self, model_key: Hashable, tokens: list[int], have: int
    ) -> tuple[list[Any], list[int]] | None:
        """A copy of the longest snapshot still waiting to be written whose tokens are a
        prefix of ``tokens[:-1]`` longer than ``have``, and the tokens after it."""
        if model_key not in self._namespaces and not isinstance(model_key, TenantKey):
            return None  # never fingerprinted here: nothing of it was queued
        namespace = self.namespace_for(model_key)  # a tenant's: derived from its model's
        if namespace is None:
            return None
        found = self._writer.pending(namespace, tokens, have)
        if found is None:
            return None
        n, cache = found
        return cache, list(tokens[n:])

    def _enqueue(
        self, model_key: Hashable, tokens: list[int], prompt_cache: list[Any], cache_type: str,
        stem: int, *, metadata: dict[str, str] | None = None, pin_ttl: float = 0.0,
    ) -> str:
        """Hand a snapshot to the write-behind queue; what became of it (the log's ``reply``):
        ``queued``, ``deferred``, ``short`` (under `min_tokens`), ``memory_only`` (a model
        key that cannot be fingerprinted) or ``closed``. ``metadata`` (a checkpoint's) is
        stored instead of ``{"cache_type": cache_type}``."""
        n = min(len(tokens), cached_tokens(prompt_cache, len(tokens)))
        if n < max(1, self.min_tokens):
            self._count("skipped")
            return "short"
        namespace = self.namespace_for(model_key)
        if namespace is None:
            self._count("skipped")
            return "memory_only"
        return self._writer.submit(namespace, list(tokens[:n]), prompt_cache, cache_type,
                                   stem=min(stem, n), metadata=metadata, pin_ttl=pin_ttl)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def _notify(self, what: str, arg: Any) -> None:
        for obs in list(self.observers):
            try:
                getattr(obs, what)(arg)
            except Exception:  # noqa: BLE001 - an observer never fails a request
                logger.warning("kvstore: %s observer failed", what, exc_info=True)

    def _finished(self, rec: RequestRecord) -> None:
        rec.placed()  # after the reply, so placing it costs no request its first token
        self._notify("finished", rec)

    def _saved(self, done: SaveDone) -> None:
        self._notify("saved", done)

    def drain(self, timeout: float | None = None) -> bool:
        """Write every pending snapshot (deferred ones too) and wait; False on timeout."""
        return self._writer.drain(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Drain the queue, stop the worker; later inserts stay in memory only."""
        drained = self._writer.close(timeout)
        self._requests.flush()
        with contextlib.suppress(Exception):
            atexit.unregister(self._atexit)
        return drained

    def __enter__(self) -> PersistentPromptCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- counters -------------------------------------------------------------------

    def persist_stats(self) -> PersistStats:
        """All counters of the disk tier at once."""
        pending, pending_bytes, deferred, deferred_bytes = self._writer.state()
        w = self._writer.counters()
        with self._lock:
            c = dict(self._counts)
        return PersistStats(
            pending=pending,
            pending_bytes=pending_bytes,
            saved=w.get("saved", 0),
            dropped=w.get("dropped", 0),
            failed=w.get("failed", 0),
            skipped=c.get("skipped", 0),
            bytes_written=w.get("bytes_written", 0),
            logical_bytes_saved=w.get("logical_bytes_saved", 0),
            memory_hits=c.get("memory_hits", 0),
            store_hits=c.get("store_hits", 0),
            misses=c.get("misses", 0),
            tokens_from_store=c.get("tokens_from_store", 0),
            deferred=deferred,
            deferred_bytes=deferred_bytes,
            superseded=w.get("superseded", 0),
            kv_bytes_added=w.get("kv_bytes_added", 0),
            recomputed=c.get("recomputed", 0),
        )

    def request_counts(self) -> Counts:
        """This process's requests by tier (a copy; the root keeps them too: Store.usage)."""
        with self._lock:
            return self._usage.copy()

    @property
    def pending(self) -> int:
        """Snapshots queued or being written."""
        return self.persist_stats().pending

    @property
    def dropped(self) -> int:
        """Snapshots shed because the queue was over `queue_bytes` (or closed)."""
        return self.persist_stats().dropped

    @property
    def failed(self) -> int:
        """Background saves that raised (logged, never re-raised)."""
        return self.persist_stats().failed

    @property
    def saved(self) -> int:
        """Background saves that committed."""
        return self.persist_stats().saved

    @property
    def bytes_written(self) -> int:
        """New (not deduplicated) bytes the background saves wrote."""
        return self.persist_stats().bytes_written
