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
import collections
import contextlib
import copy
import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import cache as _cache

from kvstore import Namespace, Store

from .fingerprint import fingerprint_model, fingerprint_model_dir, namespace_for_path
from .persist_stats import PersistStats
from .prefill import CHECKPOINT, parse_checkpoint_type

__all__ = [
    "PersistStats",
    "PersistentPromptCache",
    "fingerprint_model",
    "fingerprint_model_dir",
    "namespace_for_path",
]

logger = logging.getLogger("kvstore.mlx_lm")


# --- the write-behind queue -------------------------------------------------------


@dataclass
class _Job:
    namespace: Namespace
    tokens: list[int]
    cache: list[Any]
    cache_type: str  # "assistant", "user", "system" (mlx-lm's server's), or "checkpoint"
    nbytes: int
    metadata: dict[str, str] | None = None  # default {"cache_type": cache_type}


def _register_exit_flush(fn: Callable[[], None]) -> None:
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


def _cache_arrays(prompt_cache: Sequence[Any]) -> list[mx.array]:
    arrays: list[mx.array] = []
    for c in prompt_cache:
        leaves: Any = tree_flatten(c.state)
        arrays.extend(v for _, v in leaves if isinstance(v, mx.array))
    return arrays


def _cached_tokens(prompt_cache: Sequence[Any], n_tokens: int) -> int:
    """How many tokens the cache holds: the attention layers' offset, else `n_tokens`."""
    offsets: list[int] = []
    for c in prompt_cache:
        layers = getattr(c, "caches", None) or (c,)
        offsets.extend(int(x.offset) for x in layers if isinstance(getattr(x, "offset", None), int))
    return min(offsets) if offsets else n_tokens


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
    ) -> None:
        self.store = store
        self.reuse_prefix = reuse_prefix
        self.min_tokens = min_tokens
        self.queue_bytes = queue_bytes
        self.ns = ns
        self._memory = _cache.LRUPromptCache(max_size=max_size, max_bytes=max_bytes)
        self._namespaces: dict[Hashable, Namespace | None] = {}
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued_bytes = 0
        self._inflight = False
        self._writing: _Job | None = None  # the job the writer is saving
        self._closed = False
        self._worker: threading.Thread | None = None
        self._counts = collections.Counter[str]()
        ref = weakref.ref(self)

        def _flush_at_exit() -> None:
            obj = ref()
            if obj is not None:
                obj.close(timeout=exit_timeout)

        self._atexit: Callable[[], None] = _flush_at_exit
        _register_exit_flush(_flush_at_exit)

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
        return len(self._memory)

    @property
    def nbytes(self) -> int:
        """Bytes held by the memory tier."""
        return int(self._memory.nbytes)

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
        `tokens` and the tokens still to process (``(None, tokens)`` on a miss)."""
        cache, rest = self._memory.fetch_nearest_cache(model_key, tokens)
        if cache is not None and not rest:
            self._count("memory_hits")
            return cache, rest
        have = len(tokens) - len(rest) if cache is not None else 0
        # A snapshot still queued is looked at before the store: one the writer
        # commits meanwhile is then seen by one of the two.
        pending = self._fetch_pending(model_key, tokens, have)
        if pending is not None:
            cache, rest = pending
            have = len(tokens) - len(rest)
        found = self._fetch_from_store(model_key, tokens, have)
        if found is not None:
            self._count("store_hits")
            self._count("tokens_from_store", len(tokens) - len(found[1]))
            return found
        self._count("memory_hits" if cache is not None else "misses")
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
        checkpoint = parse_checkpoint_type(cache_type)
        if checkpoint is not None:
            self._enqueue(model_key, tokens, prompt_cache, CHECKPOINT, metadata=checkpoint)
            return
        self._memory.insert_cache(model_key, tokens, prompt_cache, cache_type=cache_type)
        self._enqueue(model_key, tokens, prompt_cache, cache_type)

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
    ) -> tuple[list[Any], list[int]] | None:
        # Look up all but the last token: like mlx-lm, leave at least one to process.
        if len(tokens) - 1 <= max(have, 0):
            return None
        namespace = self.namespace_for(model_key)
        if namespace is None:
            return None
        try:
            match = self.store.lookup(tokens[:-1], namespace=namespace)
            if match is None or match.length <= have:
                return None
            cache = self.store.load(match)
        except Exception:
            logger.warning("kvstore: store read failed; treating it as a miss", exc_info=True)
            return None
        return list(cache), list(tokens[match.length :])

    def _fetch_pending(
        self, model_key: Hashable, tokens: list[int], have: int
    ) -> tuple[list[Any], list[int]] | None:
        """A copy of the longest snapshot still waiting to be written (a checkpoint the
        writer has not reached) whose tokens are a prefix of ``tokens[:-1]`` longer
        than ``have``; None when there is none."""
        namespace = self._namespaces.get(model_key)
        if namespace is None:
            return None
        with self._cond:
            jobs = [*self._queue, *([self._writing] if self._writing is not None else [])]
            best = max(
                (j for j in jobs
                 if j.namespace == namespace and have < len(j.tokens) < len(tokens)
                 and tokens[: len(j.tokens)] == j.tokens),
                key=lambda j: len(j.tokens),
                default=None,
            )
            cache = copy.deepcopy(best.cache) if best is not None else None
        if best is None or cache is None:
            return None
        return cache, list(tokens[len(best.tokens) :])

    def _enqueue(self, model_key: Hashable, tokens: list[int], prompt_cache: list[Any],
                 cache_type: str, *, metadata: dict[str, str] | None = None) -> None:
        n = min(len(tokens), _cached_tokens(prompt_cache, len(tokens)))
        if n < max(1, self.min_tokens):
            self._count("skipped")
            return
        namespace = self.namespace_for(model_key)
        if namespace is None:
            self._count("skipped")
            return
        # Materialise on the caller's thread; the worker only reads finished bytes.
        mx.eval(_cache_arrays(prompt_cache))
        job = _Job(
            namespace,
            list(tokens[:n]),
            list(prompt_cache),
            cache_type,
            sum(int(c.nbytes) for c in prompt_cache),
            metadata,
        )
        with self._cond:
            if cache_type == CHECKPOINT:  # memory stays bounded: one waiting at most
                self._cond.wait_for(
                    lambda: self._closed
                    or not any(j.cache_type == CHECKPOINT for j in self._queue)
                )
            if self._closed:
                self._counts["dropped"] += 1
                return
            self._queue.append(job)
            self._queued_bytes += job.nbytes
            while self._queue and self._queued_bytes > self.queue_bytes:
                old = self._queue.popleft()
                self._queued_bytes -= old.nbytes
                self._counts["dropped"] += 1
                logger.warning(
                    "kvstore: write-behind queue full, dropped a %d-token snapshot", len(old.tokens)
                )
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="kvstore-write-behind", daemon=True
                )
                self._worker.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._queued_bytes -= job.nbytes
                self._inflight = True
                self._writing = job
                self._cond.notify_all()  # a checkpoint waiting for room may queue now
            try:
                info = self.store.save(
                    job.tokens,
                    job.cache,
                    metadata=job.metadata or {"cache_type": job.cache_type},
                    priority=job.cache_type,  # type: ignore[arg-type]
                    namespace=job.namespace,
                    reuse_prefix=self.reuse_prefix,
                )
            except Exception:
                logger.warning(
                    "kvstore: background save of %d tokens failed", len(job.tokens), exc_info=True
                )
                outcome: dict[str, int] = {"failed": 1}
            else:
                outcome = {
                    "saved": 1,
                    "bytes_written": int(info.new_bytes),
                    "logical_bytes_saved": int(info.logical_bytes),
                }
            del job
            with self._cond:
                self._counts.update(outcome)
                self._inflight = False
                self._writing = None
                self._cond.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counts[name] += n

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued snapshot is saved (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._inflight, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Drain the queue, stop the worker; later inserts stay in memory only."""
        drained = self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and drained:
            worker.join(timeout)
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
        with self._cond:
            c = self._counts
            return PersistStats(
                pending=len(self._queue) + int(self._inflight),
                pending_bytes=self._queued_bytes,
                saved=c["saved"],
                dropped=c["dropped"],
                failed=c["failed"],
                skipped=c["skipped"],
                bytes_written=c["bytes_written"],
                logical_bytes_saved=c["logical_bytes_saved"],
                memory_hits=c["memory_hits"],
                store_hits=c["store_hits"],
                misses=c["misses"],
                tokens_from_store=c["tokens_from_store"],
            )

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
