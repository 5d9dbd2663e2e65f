"""The codec seam: one stateless codec per cache kind, in one registry.

A codec turns a cache object into a layer record plus the arrays it holds
(:meth:`Codec.snapshot`) and back (:meth:`Codec.load`). Callers never branch on
the cache's type: :func:`codec_for_cache` and :func:`codec_for_record` pick.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import msgspec

from ..errors import UnknownCacheTypeError
from ..schema import Layer, TensorSpec
from .errors import UnknownKindError


@dataclass(frozen=True)
class TensorData:
    """One array of a snapshot, possibly a view of a larger buffer.

    The bytes stored are ``array[..., :length, ...]`` along ``axis`` (the whole
    array when ``length`` is None). ``token`` says the tensor is cut into
    token blocks; its ``length`` must then equal the entry's token count, or,
    with ``window_start``, the tokens ``[window_start, n)`` it holds (a window
    tensor, stored in window blocks at the same absolute token positions).
    Keeping the full buffer plus a length lets the store write the live rows
    straight from MLX's memory, without a slice copy.
    """

    array: mx.array
    axis: int = 0
    length: int | None = None
    token: bool = False
    window_start: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.array.shape)
        if self.length is None:
            return shape
        return shape[: self.axis] + (self.length,) + shape[self.axis + 1 :]


@dataclass(frozen=True)
class Snapshot:
    """A layer record (tensor specs not yet placed) and its arrays, in order."""

    record: Layer
    tensors: tuple[TensorData, ...]


class Codec(ABC):
    """Converts one cache kind; holds no state."""

    kind: ClassVar[str]

    @abstractmethod
    def matches(self, cache: Any) -> bool:
        """True when this codec handles ``cache`` (by exact class)."""

    @abstractmethod
    def snapshot(self, cache: Any) -> Snapshot:
        """The record and arrays of ``cache``; arrays need not be evaluated."""

    def stored(self, cache: Any, n_tokens: int) -> Snapshot:
        """The snapshot the store saves as an entry of ``n_tokens`` tokens: :meth:`snapshot`,
        unless the kind lays its tensors out so that consecutive saves of one prompt
        share blocks (a sliding window unrolled into token order). Files (mlx-bun) use
        :meth:`snapshot`."""
        return self.snapshot(cache)

    @abstractmethod
    def load(self, record: Any, arrays: list[mx.array], n_tokens: int, *, drop: int = 0) -> Any:
        """Rebuild a cache holding ``n_tokens`` tokens.

        Token-axis arrays arrive with :meth:`token_capacity` rows on their
        token axis (the first ``n_tokens`` filled); state arrays whole.
        ``drop`` is how many of the entry's last tokens a prefix restore leaves
        out: a trimmable codec whose state is not token-aligned trims that many.
        """

    def trimmable(self, record: Any) -> bool:
        """Whether a prefix shorter than the record can be served."""
        return False

    def token_capacity(self, record: Any, n_tokens: int) -> int:
        """Rows to allocate on the token axis when restoring ``n_tokens``."""
        return n_tokens

    def cut(self, record: Any, n_tokens: int) -> Layer | None:
        """The record of the first ``n_tokens`` of this layer, kept in the same token blocks.

        None when the kind cannot say that without other bytes (state that is
        not token-aligned): an entry holding such a layer is dropped, not cut
        back, when one of its blocks goes bad.
        """
        return None


def cut_token_specs(record: Layer, n_tokens: int, **fields: Any) -> Layer | None:
    """``record`` with every token tensor ``n_tokens`` long (and ``fields`` replaced).

    None when the record holds a tensor without a token axis.
    """
    specs = []
    for spec in record.tensors:
        if spec.token_axis is None or spec.window_start is not None:
            return None
        shape = list(spec.shape)
        shape[spec.token_axis] = n_tokens
        specs.append(msgspec.structs.replace(spec, shape=tuple(shape)))
    return msgspec.structs.replace(record, tensors=tuple(specs), **fields)


_BY_KIND: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    """Add ``codec`` to the registry under its ``kind``."""
    _BY_KIND[codec.kind] = codec
    return codec


def codec_for_cache(cache: Any) -> Codec:
    """The codec that handles ``cache``; an unknown class is a typed error."""
    for codec in _BY_KIND.values():
        if codec.matches(cache):
            return codec
    raise UnknownCacheTypeError(type(cache).__name__)


def codec_for_record(record: Any) -> Codec:
    """The codec registered for a record's kind."""
    kind = type(record).__struct_config__.tag
    try:
        return _BY_KIND[str(kind)]
    except KeyError:
        raise UnknownKindError(f"no codec registered for layer kind {kind!r}") from None


def snapshot(cache: Any) -> Snapshot:
    """Snapshot any cache object through the registry."""
    return codec_for_cache(cache).snapshot(cache)


def stored_snapshot(cache: Any, n_tokens: int) -> Snapshot:
    """The snapshot the store saves of any cache object (:meth:`Codec.stored`)."""
    return codec_for_cache(cache).stored(cache, n_tokens)


def leaf(record: Layer, tensors: tuple[TensorData, ...]) -> Snapshot:
    """A snapshot of a leaf layer: the record's tensor specs filled from ``tensors``.

    Specs carry shape, dtype and token axis; the store places state tensors.
    """
    specs = tuple(
        TensorSpec(
            shape=td.shape,
            dtype=str(td.array.dtype).removeprefix("mlx.core."),
            token_axis=td.axis if td.token else None,
            window_start=td.window_start if td.token else None,
        )
        for td in tensors
    )
    return Snapshot(msgspec.structs.replace(record, tensors=specs), tensors)


def step_capacity(n_tokens: int, step: int) -> int:
    """``n_tokens`` rounded up to ``step``, with at least one free slot."""
    return (n_tokens // step + 1) * step


@dataclass(frozen=True)
class AttachmentData:
    """Extra tensors saved beside a cache (mlx-bun v4 attachments).

    ``metadata`` is the JSON text of the attachment's metadata object, kept
    byte for byte so nested values and key order survive a round trip.
    """

    schema: str
    metadata: bytes = b"{}"
    tensors: tuple[mx.array, ...] = ()
