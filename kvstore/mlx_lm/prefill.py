"""Checkpoints during prefill: the state of a cache that cannot be trimmed, saved every
``every`` tokens of a prompt, so that a later prompt that diverges part-way restores the
deepest checkpoint at or before the divergence instead of prefilling from the start.

A hybrid model's cache (an SSM or convolution state beside the attention layers) and a
sliding-window layer once its ring has wrapped can only serve their exact length: a
stored entry for the end of a long prompt is no use to a prompt that shares all but its
last sentence. A checkpoint is an ordinary entry of exact length (priority
``"checkpoint"``), found by the store's usual lookup. A model whose every layer can be
trimmed (plain or quantized KV) needs none: the entry for the prompt's end serves each
of its prefixes, so it gets none.

:func:`prefill` is the Python call; :func:`split_segments` cuts mlx-lm's server
segments at the same absolute positions for ``kvstore serve``; :func:`default_every`
chooses the interval for a model.
"""

from __future__ import annotations

import array
import hashlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _cache

from kvstore import EntryInfo, KVStoreError, Namespace, NamespaceRequiredError, Store

__all__ = [
    "CHECKPOINT",
    "MIN_EVERY",
    "OVERHEAD",
    "Prefilled",
    "checkpoint_costs",
    "checkpoint_positions",
    "cut_segments",
    "default_every",
    "needs_checkpoints",
    "prefill",
    "split_segments",
]

logger = logging.getLogger("kvstore.mlx_lm")

#: The priority, and mlx-lm cache type, of a checkpoint.
CHECKPOINT = "checkpoint"
#: The default interval, per model (:func:`default_every`): at least this many tokens...
MIN_EVERY = 1024
#: ...and enough that a checkpoint's own bytes (its state, a window's partial block) are at
#: most this share of the key/value bytes of the tokens between two checkpoints. The
#: measured trade-off behind both is in docs/BENCHMARKS.md, "Checkpoints during prefill".
OVERHEAD = 0.25

C: Any = _cache
# Caches that can serve any prefix of what they hold, however long it grows.
_ALWAYS_TRIMMABLE = tuple(
    getattr(C, name) for name in ("KVCache", "QuantizedKVCache", "ConcatenateKVCache")
    if isinstance(getattr(C, name, None), type)
)


def needs_checkpoints(cache: Sequence[Any]) -> bool:
    """Whether a cache (a model's fresh one will do) has a layer that may become untrimmable:
    SSM or convolution state, a sliding window, a chunked cache; CacheLists are looked into."""

    def trims(c: Any) -> bool:
        if type(c) is C.CacheList:
            return all(trims(x) for x in c.caches)
        return type(c) in _ALWAYS_TRIMMABLE

    return not all(trims(c) for c in cache)


def checkpoint_costs(cache: Sequence[Any]) -> tuple[int, int, int]:
    """What a cache's layers store: ``(bytes a token adds to the layers that keep every
    token, bytes a token adds to the sliding windows, bytes of state without a token axis)``.

    The state (SSM recurrent and convolution state) is the floor of a checkpoint's cost;
    a sliding window adds at most one partial block of its rows.
    """
    kv = win = state = 0

    def row(a: Any) -> int:  # one token's row of a [B, H, S, D] array
        return int(a.shape[0] * a.shape[1] * a.shape[3] * a.itemsize)

    def walk(c: Any) -> None:
        nonlocal kv, win, state
        if type(c) is C.CacheList:
            for x in c.caches:
                walk(x)
        elif isinstance(getattr(c, "cache", None), list):  # ArraysCache and its kin
            state += sum(int(a.nbytes) for a in c.cache if a is not None)
        elif getattr(c, "keys", None) is not None:
            keys = c.keys if isinstance(c.keys, (list, tuple)) else [c.keys]
            values = c.values if isinstance(c.values, (list, tuple)) else [c.values]
            per = sum(row(a) for a in (*keys, *values))
            if type(c) is C.RotatingKVCache:
                win += per
            else:
                kv += per

    for c in cache:
        walk(c)
    return kv, win, state


def default_every(model: Any, block_tokens: int) -> int:
    """The interval for ``model``: the smallest multiple of ``block_tokens`` that is at least
    :data:`MIN_EVERY` and makes a checkpoint's own bytes (its state, plus one block of each
    sliding window) at most :data:`OVERHEAD` of the key/value bytes its interval adds.

    The sizes come from the model's own cache after a two-token probe (the state's shape
    does not grow with the prompt; the rows do, one per token).
    """
    cache = _cache.make_prompt_cache(model)
    if not needs_checkpoints(cache):
        return -(-MIN_EVERY // block_tokens) * block_tokens
    model(mx.array([[1, 2]]), cache=cache)
    mx.eval([c.state for c in cache])
    kv, win, state = checkpoint_costs(cache)
    own = state + block_tokens * win
    need = own / (OVERHEAD * (kv + win)) if kv + win else 0.0
    return -(-max(MIN_EVERY, math.ceil(need)) // block_tokens) * block_tokens


def checkpoint_positions(start: int, end: int, every: int) -> list[int]:
    """The absolute positions ``k * every`` in ``(start, end]``: where checkpoints go."""
    if every <= 0:
        return []
    first = (start // every + 1) * every
    return list(range(first, end + 1, every))


def conversation_id(tokens: Sequence[int]) -> str:
    """A short name for the prompt a checkpoint was taken from (its ``conversation``):
    16 hex chars of a hash of its tokens."""
    h = hashlib.blake2b(digest_size=8)
    h.update(array.array("I", tokens).tobytes())
    return h.hexdigest()


def checkpoint_metadata(conversation: str, prompt_tokens: int, every: int) -> dict[str, str]:
    """The metadata a checkpoint is saved with (``kvstore ls``/``show`` print it)."""
    return {
        "cache_type": CHECKPOINT,
        "conversation": conversation,
        "prompt_tokens": str(prompt_tokens),
        "checkpoint_every": str(every),
    }


@dataclass
class Prefilled:
    """What :func:`prefill` did: the cache after the last token, and the checkpoints saved."""

    cache: list[Any]
    checkpoints: list[EntryInfo] = field(default_factory=list)
    failed: int = 0  # saves (checkpoints, the end) that raised (logged; the prefill went on)
    end: EntryInfo | None = None  # the prompt's end, saved (``save_end``)


def _held(cache: Sequence[Any]) -> int | None:
    """Tokens a cache holds by its attention layers' offsets (None: none tell)."""
    offsets: list[int] = []
    for c in cache:
        layers = c.caches if type(c) is C.CacheList else (c,)
        offsets += [int(x.offset) for x in layers if isinstance(getattr(x, "offset", None), int)]
    return min(offsets) if offsets else None


def prefill(
    model: Any,
    tokens: Sequence[int],
    cache: list[Any] | None = None,
    *,
    store: Store,
    every: int | None = None,
    start: int | None = None,
    namespace: Namespace | None = None,
    step: int = 2048,
    on_checkpoint: Callable[[int, list[Any]], None] | None = None,
    save_end: bool = True,
) -> Prefilled:
    """Feed ``tokens[start:]`` through ``model`` into ``cache``, saving a checkpoint every
    ``every`` tokens (at absolute positions ``k * every``) when the cache cannot be trimmed.

    ``cache`` holds ``tokens[:start]`` already (from ``store.restore``, say); None is a
    fresh cache and ``start=0``. ``start`` defaults to what the cache's attention layers
    hold; a cache without any (pure SSM) must say it. ``every`` defaults to
    :func:`default_every` for the model and the root's block size (a whole number of
    blocks: a checkpoint that ends inside a block stores that partial block on its own);
    0 turns checkpoints off. Chunks of at most ``step`` tokens end at each checkpoint.
    A trimmable model gets no checkpoints. A checkpoint whose save fails is logged
    and counted in ``failed``; the prefill goes on. ``on_checkpoint(position, cache)``
    is called after each checkpoint position is reached (saved or not).

    The prompt's end (all of ``tokens``) is saved too, as ``kvstore serve`` saves it, so
    the same prompt asked again restores all of it (``end``; priority ``"user"``): unless
    ``save_end=False``, nothing was computed (``start == len(tokens)``), or a checkpoint
    already ends there. Its save failing is counted in ``failed`` as a checkpoint's is.
    """
    if cache is None:
        if start:
            raise ValueError(f"prefill: a fresh cache holds no tokens, not start={start}")
        cache = list(_cache.make_prompt_cache(model))
        start = 0
    if start is None:
        start = _held(cache)
        if start is None:
            raise ValueError("prefill: pass start= (this cache does not say how many tokens "
                             "it holds)")
    if not 0 <= start <= len(tokens):
        raise ValueError(f"prefill: start {start} is outside the {len(tokens)} tokens")
    if step <= 0:
        raise ValueError(f"prefill: step must be > 0, got {step}")
    if every is None:
        every = default_every(model, store.block_tokens)
    if every < 0:
        raise ValueError(f"prefill: every must be >= 0, got {every}")
    out = Prefilled(list(cache))
    marks = checkpoint_positions(start, len(tokens), every) if needs_checkpoints(cache) else []
    ns = store.namespace if namespace is None else namespace
    end = save_end and start < len(tokens) and len(tokens) not in marks
    if (marks or end) and ns is None:
        raise NamespaceRequiredError(
            "prefill: no namespace: pass namespace=kvstore.Namespace(...) here or to Store.open"
            + ("" if marks else " (or save_end=False)")
        )
    meta = checkpoint_metadata(conversation_id(tokens), len(tokens), every)
    pos = start
    for mark in [*marks, len(tokens)]:
        while pos < mark:
            stop = min(pos + step, mark)
            model(mx.array(list(tokens[pos:stop]))[None], cache=out.cache)
            mx.eval([c.state for c in out.cache])
            pos = stop
        if mark not in marks:
            break
        if on_checkpoint is not None:
            on_checkpoint(mark, out.cache)
        try:
            out.checkpoints.append(store.save(
                list(tokens[:mark]), out.cache, namespace=ns, metadata=meta,
                priority="checkpoint", reuse_prefix=True,
            ))
        except (KVStoreError, OSError):
            out.failed += 1
            logger.warning("kvstore: checkpoint at token %d not saved", mark, exc_info=True)
    if end:
        try:
            out.end = store.save(list(tokens), out.cache, namespace=ns, priority="user",
                                 reuse_prefix=True)
        except (KVStoreError, OSError):
            out.failed += 1
            logger.warning("kvstore: the prompt's end (%d tokens) not saved", len(tokens),
                           exc_info=True)
    return out


def split_segments(
    segments: Sequence[Sequence[int]], types: Sequence[str], start: int, every: int
) -> tuple[list[list[int]], list[str]]:
    """mlx-lm server's prompt segments cut again at each absolute position ``k * every``.

    The segments follow one another from token ``start``; a piece that ends at a cut
    and not at its segment's end gets the type :data:`CHECKPOINT` (the server hands
    the cache there to ``insert_cache`` with that type), the last piece of each segment
    keeps the segment's own.
    """
    out: list[list[int]] = []
    kinds: list[str] = []
    pos = start
    for seg, kind in zip(segments, types, strict=True):
        end = pos + len(seg)
        cuts = [p for p in checkpoint_positions(pos, end, every) if p < end]
        a = pos
        for p in cuts:
            out.append(list(seg[a - pos : p - pos]))
            kinds.append(CHECKPOINT)
            a = p
        out.append(list(seg[a - pos :]))
        kinds.append(kind)
        pos = end
    return out, kinds


def cut_segments(segments: Sequence[Sequence[int]], types: Sequence[str],
                 marks: Mapping[int, str]) -> tuple[list[list[int]], list[str]]:
    """mlx-lm server's prompt segments (from token 0) cut again at each absolute position of
    ``marks``: the piece that ends at a mark gets the mark's type (a segment's own end
    included), every other piece its segment's."""
    out: list[list[int]] = []
    kinds: list[str] = []
    pos = 0
    for seg, kind in zip(segments, types, strict=True):
        end = pos + len(seg)
        a = pos
        for p in sorted(m for m in marks if pos < m <= end):
            out.append(list(seg[a - pos : p - pos]))
            kinds.append(marks[p])
            a = p
        if a < end:
            out.append(list(seg[a - pos :]))
            kinds.append(kind)
        pos = end
    return out, kinds


# --- kvstore serve: finer segments in mlx-lm's server ------------------------------------
#
# mlx-lm's server cuts a chat prompt into segments (system prompt, user part, thinking
# tail) and, at the end of each, hands the cache to ``prompt_cache.insert_cache`` with
# the segment's type. Cutting the segments again at every ``k * every`` makes the server
# stop there too; the type of such a cut names the checkpoint (its conversation, the
# prompt's length and the interval) for PersistentPromptCache, which saves it to the
# store and keeps it out of the in-memory LRU.

_TYPE_PREFIX = CHECKPOINT + ":"


def checkpoint_type(conversation: str, prompt_tokens: int, every: int) -> str:
    """The segment type of a checkpoint cut (what ``insert_cache`` receives)."""
    return f"{_TYPE_PREFIX}{conversation}:{prompt_tokens}:{every}"


def parse_checkpoint_type(cache_type: str) -> dict[str, str] | None:
    """The metadata of a checkpoint from its segment type; None for any other type."""
    if cache_type == CHECKPOINT:
        return {"cache_type": CHECKPOINT}
    if not cache_type.startswith(_TYPE_PREFIX):
        return None
    parts = cache_type[len(_TYPE_PREFIX) :].split(":")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return checkpoint_metadata(parts[0], int(parts[1]), int(parts[2]))


Tokenize = Callable[..., tuple[Any, ...]]


def segmenting_tokenize(tokenize: Tokenize, every: int | None, block_tokens: int) -> Tokenize:
    """mlx-lm's ``ResponseGenerator._tokenize``, its segments cut every ``every`` tokens
    (None: :func:`default_every` for the model) when the model's cache cannot be trimmed
    (and left alone otherwise)."""
    decided: dict[int, int] = {}  # id(model) -> its interval, 0 for none

    def wrapper(self: Any, tokenizer: Any, request: Any, args: Any) -> tuple[Any, ...]:
        out = tokenize(self, tokenizer, request, args)
        prompt, segments, types, state, vision = out
        model = getattr(getattr(self, "model_provider", None), "model", None)
        if every == 0 or vision is not None or model is None:
            return out
        if id(model) not in decided:
            decided.clear()  # one model at a time: the server loads one
            wanted = needs_checkpoints(_cache.make_prompt_cache(model))
            n = (default_every(model, block_tokens) if every is None else every) if wanted else 0
            decided[id(model)] = n
            if n:
                logger.info("kvstore: a checkpoint every %d prompt tokens", n)
            else:
                logger.info("kvstore: no checkpoints: this model's cache can be trimmed")
        n = decided[id(model)]
        if not n:
            return out
        pieces, kinds = split_segments(segments, types, 0, n)
        conv = conversation_id(prompt)
        mark = checkpoint_type(conv, len(prompt), n)
        kinds = [mark if k == CHECKPOINT else k for k in kinds]
        return prompt, pieces, kinds, state, vision

    return wrapper
