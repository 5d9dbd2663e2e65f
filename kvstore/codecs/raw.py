"""Foreign cache kinds with no mlx-lm class (mlx-bun's mla, paged, …), kept losslessly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..schema import RawLayer
from .base import Codec, Snapshot, TensorData, leaf, register


@dataclass
class RawCache:
    """A cache layer kvstore cannot run but must keep: its kind, fields and tensors.

    ``fields`` is the JSON object of the layer's non-tensor fields in their
    original key order; ``tensors`` are kept whole and in order.
    """

    source_kind: str
    fields: bytes = b"{}"
    tensors: list[mx.array] = field(default_factory=list)
    trimmable: bool = False
    kvstore_extra: bytes = b""

    @property
    def nbytes(self) -> int:
        return sum(int(t.nbytes) for t in self.tensors)


class RawCodec(Codec):
    kind = "raw"

    def matches(self, cache: Any) -> bool:
        return type(cache) is RawCache

    def snapshot(self, cache: Any) -> Snapshot:
        rec = RawLayer(
            source_kind=cache.source_kind,
            fields=cache.fields,
            trimmable=False,
            extra=cache.kvstore_extra,
        )
        return leaf(rec, tuple(TensorData(t) for t in cache.tensors))

    def load(self, record: Any, arrays: list[mx.array], n_tokens: int, *, drop: int = 0) -> Any:
        return RawCache(
            source_kind=record.source_kind,
            fields=record.fields,
            tensors=list(arrays),
            kvstore_extra=record.extra,
        )


register(RawCodec())
