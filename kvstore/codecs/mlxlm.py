"""Codecs for mlx-lm's own cache classes (``mlx_lm.models.cache``).

mlx-lm is imported on first use, not with this module: importing it loads
transformers (about a second, more on a slow machine), and the commands that only
read the index (``stats``, ``ls``, ``verify``, ``compact``, …) never need a cache
class. A cache object can only be one of mlx-lm's classes once mlx-lm is loaded,
so :meth:`matches` answers False before that without importing anything; a
restore (``load``) imports it.
"""

from __future__ import annotations

import sys
from abc import abstractmethod
from typing import Any, ClassVar

import mlx.core as mx
import msgspec

from ..errors import CacheMismatchError
from ..schema import (
    ArraysLayer,
    ChunkedLayer,
    KVLayer,
    Layer,
    ListLayer,
    QuantizedLayer,
    RotatingLayer,
    WindowLayer,
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
    stored_snapshot,
)

_MODULE = "mlx_lm.models.cache"
_SEQ = 2  # the token axis of [B, H, S, D] keys and values


def _classes() -> Any:
    """mlx-lm's cache module, imported now if it is not yet (mlx-lm ships no type hints)."""
    import mlx_lm.models.cache as module

    return module


def _is(cache: Any, name: str) -> bool:
    """Whether ``cache`` is exactly mlx-lm's class ``name``; never imports mlx-lm."""
    module = sys.modules.get(_MODULE)
    return module is not None and type(cache) is getattr(module, name, None)


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


class _KVLike(Codec):
    """A cache of keys and values ``[B, H, S, D]`` (mlx-lm's KV kinds); a kind states what differs.

    The rows are the tokens, in order, from the first, while :meth:`aligned` says
    so: then the tensors go in token blocks, a prefix can be served (and cut back
    to), and a restore allocates the class's step capacity.
    """

    mlx_name: ClassVar[str]  # the exact mlx-lm class, by its name in mlx_lm.models.cache
    # the class's ``step`` (its capacity grows by that many rows), known here so that
    # planning a file's layers (``kvstore inspect``) never imports mlx-lm, which loads
    # transformers (seconds); tests/codecs check it against mlx-lm's own
    step: ClassVar[int] = 256

    @property
    def mlx_class(self) -> Any:
        return getattr(_classes(), self.mlx_name)

    def matches(self, cache: Any) -> bool:
        return _is(cache, self.mlx_name)

    def snapshot(self, cache: Any) -> Snapshot:
        if cache.keys is None:
            raise CacheMismatchError(f"{self.mlx_class.__name__} is empty (no keys)")
        rows, token = self.rows(cache)
        rec = self.record(cache)
        return leaf(rec, tuple(_live(cache, a, rows, token) for a in self.arrays(cache)))

    def rows(self, cache: Any) -> tuple[int, bool]:
        """Live rows of each tensor, and whether they are the tokens (token blocks)."""
        return int(cache.offset), True

    def arrays(self, cache: Any) -> tuple[Any, ...]:
        """The tensors, in record order."""
        return cache.keys, cache.values

    @abstractmethod
    def record(self, cache: Any) -> Layer:
        """The layer record of ``cache`` (tensor specs not yet placed)."""

    def load(self, record: Any, arrays: list[mx.array], n_tokens: int, *, drop: int = 0) -> Any:
        obj = self.new(record)
        obj.keys, obj.values = self.pair(arrays)
        obj.offset = n_tokens
        self.restore(obj, record, n_tokens, drop)
        return _keep_extra(obj, record)

    def pair(self, arrays: list[mx.array]) -> tuple[Any, Any]:
        """The loaded tensors as (keys, values)."""
        keys, values = arrays
        return keys, values

    def new(self, record: Any) -> Any:
        """An empty cache object for ``record``."""
        return self.mlx_class()

    def restore(self, obj: Any, record: Any, n_tokens: int, drop: int) -> None:
        """Set what else ``obj`` holds beside keys, values and ``offset = n_tokens``."""

    def aligned(self, record: Any) -> bool:
        """Whether the stored rows are the tokens, in order, from the first."""
        return True

    def trimmable(self, record: Any) -> bool:
        return self.aligned(record)

    def token_capacity(self, record: Any, n_tokens: int) -> int:
        if not self.aligned(record):
            return n_tokens
        return step_capacity(n_tokens, self.step)

    def cut(self, record: Any, n_tokens: int) -> Layer | None:
        if not self.aligned(record):
            return None
        return cut_token_specs(record, n_tokens, offset=n_tokens)


class KVCodec(_KVLike):
    kind = "kv"
    mlx_name = "KVCache"

    def record(self, cache: Any) -> Layer:
        return KVLayer(offset=int(cache.offset), extra=_extra(cache))


class QuantizedCodec(_KVLike):
    """Keys and values are each a (data, scales, biases) triple."""

    kind = "qkv"
    mlx_name = "QuantizedKVCache"

    def arrays(self, cache: Any) -> tuple[Any, ...]:
        return (*cache.keys, *cache.values)

    def record(self, cache: Any) -> Layer:
        return QuantizedLayer(
            offset=int(cache.offset),
            group_size=int(cache.group_size),
            bits=int(cache.bits),
            extra=_extra(cache),
        )

    def pair(self, arrays: list[mx.array]) -> tuple[Any, Any]:
        half = len(arrays) // 2
        return tuple(arrays[:half]), tuple(arrays[half:])

    def new(self, record: Any) -> Any:
        return self.mlx_class(group_size=record.group_size, bits=record.bits)


class RotatingCodec(_KVLike):
    """The ring is state (its rows are not in token order once it wraps)."""

    kind = "rotating"
    mlx_name = "RotatingKVCache"

    def rows(self, cache: Any) -> tuple[int, bool]:
        _check_rank(cache, cache.keys)
        return min(int(cache.offset), cache.keys.shape[_SEQ]), False

    def record(self, cache: Any) -> Layer:
        return RotatingLayer(
            offset=int(cache.offset),
            max_size=int(cache.max_size),
            keep=int(cache.keep),
            idx=int(cache._idx),
            extra=_extra(cache),
        )

    def new(self, record: Any) -> Any:
        return self.mlx_class(max_size=record.max_size, keep=record.keep)

    def restore(self, obj: Any, record: Any, n_tokens: int, drop: int) -> None:
        obj.offset = record.offset
        obj._idx = record.idx
        if drop:
            obj.trim(drop)

    def aligned(self, record: Any) -> bool:
        return False

    def trimmable(self, record: Any) -> bool:
        return bool(record.offset < record.max_size)

    def stored(self, cache: Any, n_tokens: int) -> Snapshot:
        """The ring unrolled into token order (a :class:`WindowLayer`) when it holds the
        entry's last tokens and can be rolled back exactly; else as laid out."""
        unrolled = _unroll(cache) if int(cache.offset) == n_tokens else None
        if unrolled is None:
            return self.snapshot(cache)
        start, keys, values = unrolled
        rec = WindowLayer(
            offset=int(cache.offset), max_size=int(cache.max_size), idx=int(cache._idx),
            extra=_extra(cache),
        )
        rows = int(cache.offset) - start
        return leaf(rec, tuple(
            TensorData(a, axis=_SEQ, length=rows, token=True, window_start=start)
            for a in (keys, values)
        ))


def _unroll(cache: Any) -> tuple[int, Any, Any] | None:
    """``(first token held, keys, values)`` of a ring in token order, or None.

    mlx-lm leaves a ``keep=0`` ring in one of three shapes: in token order with
    ``_idx`` at its end (after a prefill chunk, or while it grows), or full
    (``max_size`` rows) and wrapped at ``_idx``. Anything else (``keep`` rows, a
    foreign file's layout) is stored as laid out.
    """
    keys, values = cache.keys, cache.values
    if int(cache.keep) != 0 or keys is None or values is None:
        return None
    _check_rank(cache, keys)
    _check_rank(cache, values)
    size, offset, idx = keys.shape[_SEQ], int(cache.offset), int(cache._idx)
    if values.shape[_SEQ] != size or offset <= 0:
        return None
    if idx == size and offset >= size:  # token order, every row live
        return offset - size, keys, values
    if idx == offset < size:  # still growing: rows [0, offset) live
        return 0, keys, values  # the store writes the first `offset` rows
    if size == int(cache.max_size) and 0 < idx < size and offset > size:  # wrapped
        def unroll(a: Any) -> Any:
            return mx.concatenate([a[..., idx:, :], a[..., :idx, :]], axis=_SEQ)

        return offset - size, unroll(keys), unroll(values)
    return None


class WindowCodec(_KVLike):
    """A :class:`WindowLayer`: a ring stored in token order, rolled back on restore.

    Never picked for a cache object (``RotatingKVCache`` is the rotating codec's,
    whose :meth:`RotatingCodec.stored` writes this record); it only loads.
    """

    kind = "window"
    mlx_name = "RotatingKVCache"

    def matches(self, cache: Any) -> bool:
        return False

    def record(self, cache: Any) -> Layer:
        raise AssertionError("a window record is written by RotatingCodec.stored")

    def new(self, record: Any) -> Any:
        return self.mlx_class(max_size=record.max_size, keep=0)

    def load(self, record: Any, arrays: list[mx.array], n_tokens: int, *, drop: int = 0) -> Any:
        obj = self.new(record)
        keys, values = arrays
        rows = keys.shape[_SEQ]
        idx = int(record.idx)
        if idx != rows:  # wrapped at idx: the row at idx is the oldest
            if not 0 < idx < rows:
                raise CacheMismatchError(f"window layer: ring position {idx} of {rows} rows")
            keys, values = (
                mx.concatenate([a[..., rows - idx :, :], a[..., : rows - idx, :]], axis=_SEQ)
                for a in (keys, values)
            )
        obj.keys, obj.values = keys, values
        obj.offset = record.offset
        obj._idx = idx
        if drop:
            obj.trim(drop)
        return _keep_extra(obj, record)

    def aligned(self, record: Any) -> bool:
        return False

    def trimmable(self, record: Any) -> bool:
        return bool(record.offset < record.max_size)


class ChunkedCodec(_KVLike):
    """Token-aligned while nothing was dropped from the front; state after."""

    kind = "chunked"
    mlx_name = "ChunkedKVCache"

    def rows(self, cache: Any) -> tuple[int, bool]:
        start = int(cache.start_position)
        return int(cache.offset) - start, start == 0

    def record(self, cache: Any) -> Layer:
        return ChunkedLayer(
            offset=int(cache.offset),
            chunk_size=int(cache.chunk_size),
            start_position=int(cache.start_position),
            extra=_extra(cache),
        )

    def new(self, record: Any) -> Any:
        return self.mlx_class(record.chunk_size)

    def restore(self, obj: Any, record: Any, n_tokens: int, drop: int) -> None:
        obj.start_position = record.start_position
        if not self.aligned(record):
            obj.offset = record.offset

    def aligned(self, record: Any) -> bool:
        return bool(record.start_position == 0)


def _arrays_classes() -> dict[str, Any]:
    C = _classes()
    classes: dict[str, Any] = {"ArraysCache": C.ArraysCache}
    mamba = getattr(C, "MambaCache", None)  # gone from recent mlx-lm; kept when present
    if isinstance(mamba, type):
        classes["MambaCache"] = mamba
    return classes


class ArraysCodec(Codec):
    kind = "arrays"

    def matches(self, cache: Any) -> bool:
        return _MODULE in sys.modules and type(cache) in _arrays_classes().values()

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
        classes = _arrays_classes()
        cls = classes.get(record.cls, classes["ArraysCache"])
        obj = cls.__new__(cls)
        it = iter(arrays)
        obj.cache = [next(it) if p else None for p in record.present]
        obj.left_padding = next(it) if record.has_left_padding else None
        obj.lengths = next(it) if record.has_lengths else None
        return _keep_extra(obj, record)


class ListCodec(Codec):
    kind = "list"

    def matches(self, cache: Any) -> bool:
        return _is(cache, "CacheList")

    def snapshot(self, cache: Any) -> Snapshot:
        return self._join(cache, [snapshot(c) for c in cache.caches])

    def stored(self, cache: Any, n_tokens: int) -> Snapshot:
        return self._join(cache, [stored_snapshot(c, n_tokens) for c in cache.caches])

    def _join(self, cache: Any, snaps: list[Snapshot]) -> Snapshot:
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
        return _keep_extra(_classes().CacheList(*children), record)

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
    WindowCodec(),
    ChunkedCodec(),
    ArraysCodec(),
    ListCodec(),
):
    register(_codec)
