"""Codecs for mlx-lm's own cache classes (``mlx_lm.models.cache``)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import msgspec
from mlx_lm.models import cache as _cache

from ..errors import CacheMismatchError
from ..schema import (
    ArraysLayer,
    ChunkedLayer,
    KVLayer,
    Layer,
    ListLayer,
    QuantizedLayer,
    RotatingLayer,
)
from .base import (
    Codec,
    Snapshot,
    TensorData,
    codec_for_record,
    cut_token_specs,
    leaf,
    register,
    snapshot,
    step_capacity,
)

C: Any = _cache  # mlx-lm ships no type hints
_SEQ = 2  # the token axis of [B, H, S, D] keys and values


def _extra(cache: Any) -> bytes:
    extra = getattr(cache, "kvstore_extra", b"")
    return extra if isinstance(extra, bytes) else b""


def _keep_extra(obj: Any, record: Layer) -> Any:
    if record.extra:
        obj.kvstore_extra = record.extra
    return obj


def _check_rank(cache: Any, arr: Any) -> None:
    """Keys and values are ``[B, H, S, D]``: anything else is a typed error, not an IndexError."""
    if not isinstance(arr, mx.array) or arr.ndim != 4:
        shape = tuple(arr.shape) if isinstance(arr, mx.array) else type(arr).__name__
        raise CacheMismatchError(
            f"{type(cache).__name__}: keys and values must be 4-D [B, H, S, D] arrays, "
            f"got shape {shape}"
        )


def _live(cache: Any, arr: mx.array, length: int, token: bool) -> TensorData:
    _check_rank(cache, arr)
    if length > arr.shape[_SEQ]:
        raise CacheMismatchError(
            f"{type(cache).__name__}: offset {length} exceeds buffer of {arr.shape[_SEQ]} rows"
        )
    return TensorData(arr, axis=_SEQ, length=length, token=token)


class KVCodec(Codec):
    kind = "kv"

    def matches(self, cache: Any) -> bool:
        return type(cache) is C.KVCache

    def snapshot(self, cache: Any) -> Snapshot:
        if cache.keys is None:
            raise CacheMismatchError("KVCache is empty (no keys)")
        n = int(cache.offset)
        return leaf(
            KVLayer(offset=n, extra=_extra(cache)),
            (_live(cache, cache.keys, n, True), _live(cache, cache.values, n, True)),
        )

    def load(self, record: Any, arrays: list[mx.array], n_tokens: int, *, drop: int = 0) -> Any:
        obj = C.KVCache()
        obj.keys, obj.values = arrays
        obj.offset = n_tokens
        return _keep_extra(obj, record)

    def trimmable(self, record: Any) -> bool:
        return True

    def token_capacity(self, record: Any, n_tokens: int) -> int:
        return step_capacity(n_tokens, C.KVCache.step)

    def cut(self, record: Any, n_tokens: int) -> Layer | None:
        return cut_token_specs(record, n_tokens, offset=n_tokens)


class QuantizedCodec(Codec):
    kind = "qkv"

    def matches(self, cache: Any) -> bool:
        return type(cache) is C.QuantizedKVCache

    def snapshot(self, cache: Any) -> Snapshot:
        if cache.keys is None:
            raise CacheMismatchError("QuantizedKVCache is empty (no keys)")
        n = int(cache.offset)
        parts = [_live(cache, a, n, True) for a in (*cache.keys, *cache.values)]
        rec = QuantizedLayer(
            offset=n, group_size=int(cache.group_size), bits=int(cache.bits), extra=_extra(cache)
        )
        return leaf(rec, tuple(parts))

    def load(self, record: Any, arrays: list[mx.array], n_tokens: int, *, drop: int = 0) -> Any:
        obj = C.QuantizedKVCache(group_size=record.group_size, bits=record.bits)
        half = len(arrays) // 2
        obj.keys, obj.values = tuple(arrays[:half]), tuple(arrays[half:])
        obj.offset = n_tokens
        return _keep_extra(obj, record)

    def trimmable(self, record: Any) -> bool:
        return True

    def token_capacity(self, record: Any, n_tokens: int) -> int:
        return step_capacity(n_tokens, C.QuantizedKVCache.step)

    def cut(self, record: Any, n_tokens: int) -> Layer | None:
        return cut_token_specs(record, n_tokens, offset=n_tokens)


class RotatingCodec(Codec):
    """The ring is state (its rows are not in token order once it wraps)."""

    kind = "rotating"

    def matches(self, cache: Any) -> bool:
        return type(cache) is C.RotatingKVCache

    def snapshot(self, cache: Any) -> Snapshot:
        if cache.keys is None:
            raise CacheMismatchError("RotatingKVCache is empty (no keys)")
        _check_rank(cache, cache.keys)
        rows = min(int(cache.offset), cache.keys.shape[_SEQ])
        rec = RotatingLayer(
            offset=int(cache.offset),
            max_size=int(cache.max_size),
            keep=int(cache.keep),
            idx=int(cache._idx),
            extra=_extra(cache),
        )
        return leaf(
            rec, (_live(cache, cache.keys, rows, False), _live(cache, cache.values, rows, False))
        )

    def load(self, record: Any, arrays: list[mx.array], n_tokens: int, *, drop: int = 0) -> Any:
        obj = C.RotatingKVCache(max_size=record.max_size, keep=record.keep)
        obj.keys, obj.values = arrays
        obj.offset = record.offset
        obj._idx = record.idx
        if drop:
            obj.trim(drop)
        return _keep_extra(obj, record)

    def trimmable(self, record: Any) -> bool:
        return bool(record.offset < record.max_size)


class ChunkedCodec(Codec):
    """Token-aligned while nothing was dropped from the front; state after."""

    kind = "chunked"

    def matches(self, cache: Any) -> bool:
        return type(cache) is C.ChunkedKVCache

    def snapshot(self, cache: Any) -> Snapshot:
        if cache.keys is None:
            raise CacheMismatchError("ChunkedKVCache is empty (no keys)")
        start = int(cache.start_position)
        rows = int(cache.offset) - start
        token = start == 0
        rec = ChunkedLayer(
            offset=int(cache.offset),
            chunk_size=int(cache.chunk_size),
            start_position=start,
            extra=_extra(cache),
        )
        return leaf(
            rec, (_live(cache, cache.keys, rows, token), _live(cache, cache.values, rows, token))
        )

    def load(self, record: Any, arrays: list[mx.array], n_tokens: int, *, drop: int = 0) -> Any:
        obj = C.ChunkedKVCache(record.chunk_size)
        obj.keys, obj.values = arrays
        obj.start_position = record.start_position
        obj.offset = n_tokens if record.start_position == 0 else record.offset
        return _keep_extra(obj, record)

    def trimmable(self, record: Any) -> bool:
        return bool(record.start_position == 0)

    def token_capacity(self, record: Any, n_tokens: int) -> int:
        return step_capacity(n_tokens, C.ChunkedKVCache.step)

    def cut(self, record: Any, n_tokens: int) -> Layer | None:
        if record.start_position != 0:
            return None
        return cut_token_specs(record, n_tokens, offset=n_tokens)


def _arrays_classes() -> dict[str, type]:
    classes: dict[str, type] = {"ArraysCache": C.ArraysCache}
    mamba = getattr(C, "MambaCache", None)  # gone from recent mlx-lm; kept when present
    if isinstance(mamba, type):
        classes["MambaCache"] = mamba
    return classes


class ArraysCodec(Codec):
    kind = "arrays"

    def matches(self, cache: Any) -> bool:
        return type(cache) in _arrays_classes().values()

    def snapshot(self, cache: Any) -> Snapshot:
        slots = list(cache.cache)
        if all(a is None for a in slots):
            raise CacheMismatchError(f"{type(cache).__name__} is empty (every slot is None)")
        parts = [TensorData(a) for a in slots if a is not None]
        lp, lengths = cache.left_padding, cache.lengths
        if lp is not None:
            parts.append(TensorData(lp))
        if lengths is not None:
            parts.append(TensorData(lengths))
        rec = ArraysLayer(
            cls=type(cache).__name__,
            size=len(slots),
            present=tuple(a is not None for a in slots),
            has_left_padding=lp is not None,
            has_lengths=lengths is not None,
            extra=_extra(cache),
        )
        return leaf(rec, tuple(parts))

    def load(self, record: Any, arrays: list[mx.array], n_tokens: int, *, drop: int = 0) -> Any:
        cls = _arrays_classes().get(record.cls, C.ArraysCache)
        obj = cls.__new__(cls)
        it = iter(arrays)
        obj.cache = [next(it) if p else None for p in record.present]
        obj.left_padding = next(it) if record.has_left_padding else None
        obj.lengths = next(it) if record.has_lengths else None
        return _keep_extra(obj, record)


class ListCodec(Codec):
    kind = "list"

    def matches(self, cache: Any) -> bool:
        return type(cache) is C.CacheList

    def snapshot(self, cache: Any) -> Snapshot:
        snaps = [snapshot(c) for c in cache.caches]
        tensors = tuple(t for s in snaps for t in s.tensors)
        rec = ListLayer(children=tuple(s.record for s in snaps), extra=_extra(cache))
        return Snapshot(rec, tensors)

    def load(self, record: Any, arrays: list[mx.array], n_tokens: int, *, drop: int = 0) -> Any:
        from ..schema import iter_tensor_specs

        children = []
        pos = 0
        for child in record.children:
            count = len(iter_tensor_specs((child,)))
            children.append(
                codec_for_record(child).load(child, arrays[pos : pos + count], n_tokens, drop=drop)
            )
            pos += count
        return _keep_extra(C.CacheList(*children), record)

    def trimmable(self, record: Any) -> bool:
        return all(codec_for_record(c).trimmable(c) for c in record.children)

    def token_capacity(self, record: Any, n_tokens: int) -> int:
        raise AssertionError("a CacheList has no tensors of its own")

    def cut(self, record: Any, n_tokens: int) -> Layer | None:
        children = []
        for child in record.children:
            c = codec_for_record(child).cut(child, n_tokens)
            if c is None:
                return None
            children.append(c)
        out: Layer = msgspec.structs.replace(record, children=tuple(children))
        return out


for _codec in (
    KVCodec(),
    QuantizedCodec(),
    RotatingCodec(),
    ChunkedCodec(),
    ArraysCodec(),
    ListCodec(),
):
    register(_codec)
