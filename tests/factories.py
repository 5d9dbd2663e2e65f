"""Tiny random mlx-lm caches for tests, one builder per kind."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

B, H, D = 1, 2, 32


def kv_pair(n: int, seed: int, dtype: mx.Dtype = mx.bfloat16) -> tuple[mx.array, mx.array]:
    """Keys and values for ``n`` tokens, derived from ``seed`` only."""
    k = mx.random.normal((B, H, n, D), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((B, H, n, D), key=mx.random.key(seed + 7919)).astype(dtype)
    return k, v


def kv_cache(n: int, seed: int = 0, dtype: mx.Dtype = mx.bfloat16, chunks: int = 1) -> C.KVCache:
    """A KVCache filled like prefill does (in ``chunks`` steps), full-capacity buffer."""
    c = C.KVCache()
    k, v = kv_pair(n, seed, dtype)
    bounds = [n * i // chunks for i in range(chunks + 1)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        c.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
    return c


def token_rows(
    tokens: Sequence[int], salt: int, *, heads: int = H, dim: int = D,
    dtype: mx.Dtype = mx.bfloat16,
) -> mx.array:
    """[1, heads, len, dim] integers < 2039, each row a function of its token (and ``salt``)
    alone: any process rebuilds the same rows, and equal prefixes give equal rows."""
    t = mx.array(list(tokens), dtype=mx.int32).reshape(1, 1, -1, 1)
    h = mx.arange(heads, dtype=mx.int32).reshape(1, heads, 1, 1)
    d = mx.arange(dim, dtype=mx.int32).reshape(1, 1, 1, dim)
    return ((t * 131 + h * 17 + d * 7 + salt) % 2039).astype(dtype)


def prefix_cache(
    tokens: Sequence[int], dtype: mx.Dtype = mx.bfloat16, *, heads: int = H, dim: int = D
) -> C.KVCache:
    """A KVCache whose row i is a function of tokens[i] alone (so equal prefixes give
    equal rows, as a causal model does)."""
    c = C.KVCache()
    c.update_and_fetch(
        token_rows(tokens, 0, heads=heads, dim=dim, dtype=dtype),
        token_rows(tokens, 1000, heads=heads, dim=dim, dtype=dtype),
    )
    return c


def rotating_cache(
    n: int, max_size: int, seed: int = 0, keep: int = 0, dtype: mx.Dtype = mx.bfloat16
) -> C.RotatingKVCache:
    """Prefill half, then decode one token at a time (the in-place ring path)."""
    c = C.RotatingKVCache(max_size=max_size, keep=keep)
    k, v = kv_pair(n, seed, dtype)
    first = min(n, max_size // 2) or 1
    c.update_and_fetch(k[:, :, :first], v[:, :, :first])
    for i in range(first, n):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    return c


def prefilled_rotating_cache(
    n: int, max_size: int, chunk: int, seed: int = 0, dtype: mx.Dtype = mx.bfloat16
) -> C.RotatingKVCache:
    """A ``keep=0`` ring fed ``chunk`` tokens at a time, as a prefill feeds it (the concat
    path: in token order, up to ``max_size - 1 + chunk`` rows)."""
    c = C.RotatingKVCache(max_size=max_size, keep=0)
    k, v = kv_pair(n, seed, dtype)
    for i in range(0, n, chunk):
        c.update_and_fetch(k[:, :, i : i + chunk], v[:, :, i : i + chunk])
    return c


def quantized_cache(
    n: int, seed: int = 0, bits: int = 4, group_size: int = 32
) -> C.QuantizedKVCache:
    c = C.QuantizedKVCache(group_size=group_size, bits=bits)
    k, v = kv_pair(n, seed, mx.float16)
    c.update_and_fetch(k, v)
    return c


def arrays_cache(seed: int = 0, dtype: mx.Dtype = mx.float32) -> C.ArraysCache:
    c = C.ArraysCache(2)
    c[0] = mx.random.normal((B, 3, 32), key=mx.random.key(seed)).astype(dtype)
    c[1] = mx.random.normal((B, 4, 8, 8), key=mx.random.key(seed + 1)).astype(dtype)
    return c


def chunked_cache(n: int, chunk: int, seed: int = 0) -> C.ChunkedKVCache:
    c = C.ChunkedKVCache(chunk)
    k, v = kv_pair(n, seed)
    c.update_and_fetch(k, v)
    c.maybe_trim_front()
    return c


def cache_list(n: int, seed: int = 0) -> C.CacheList:
    return C.CacheList(
        kv_cache(n, seed), C.CacheList(arrays_cache(seed + 3), kv_cache(n, seed + 5))
    )


def state_arrays(cache: Any) -> list[mx.array]:
    """Every array a cache holds, live rows only, in a canonical order."""
    if isinstance(cache, C.CacheList):
        return [a for c in cache.caches for a in state_arrays(c)]
    if isinstance(cache, C.ArraysCache):
        return [a for a in cache.cache if a is not None]
    if isinstance(cache, C.QuantizedKVCache):
        return [a[..., : cache.offset, :] for a in (*cache.keys, *cache.values)]
    if isinstance(cache, C.RotatingKVCache):  # the ring as stored: the live rows, unordered
        rows = min(cache.offset, cache.keys.shape[2])
        return [cache.keys[..., :rows, :], cache.values[..., :rows, :]]
    k, v = cache.keys_and_values()  # KVCache, ChunkedKVCache: the live rows
    return [k, v]


def same_bits(a: mx.array, b: mx.array) -> bool:
    """Bit-exact equality, dtype and shape included (NaN-safe: compares bytes)."""
    mx.eval(a, b)
    return (
        a.dtype == b.dtype and a.shape == b.shape and bytes(memoryview(a)) == bytes(memoryview(b))
    )


Factory = Callable[[int], list[Any]]
