"""mlx-bun layer kinds <-> cache objects (mlx-lm classes, or :class:`RawCache`).

Each mlx-bun kind with an mlx-lm class becomes a manifest record that the
codec registry loads, so a layer read from a file is the same object the store
restores. Header fields the mlx-lm object has no place for travel in its
``kvstore_extra`` (a JSON object) and are written back where mlx-bun puts
them. Kinds with no mlx-lm class load as :class:`RawCache`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..codecs.base import TensorData, codec_for_record, snapshot
from ..codecs.raw import RawCache
from ..errors import CacheMismatchError
from ..schema import ArraysLayer, KVLayer, Layer, QuantizedLayer, RawLayer, RotatingLayer
from . import _v3json
from .errors import LayerError

# mlx-bun kinds that have no mlx-lm class, and whether a prefix of one can be served.
RAW_KINDS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "rotating-qkv": lambda e: int(e.get("offset", 0)) < int(e.get("maxSize", 0)),
    "turboquant": lambda e: True,
    "paged": lambda e: False,
    "mla": lambda e: True,
    "mla-dsa": lambda e: True,
    "mtp-mla": lambda e: True,
}
LIB_KINDS = ("kv", "rotating", "qkv", "ssm")
KNOWN_KINDS = frozenset(LIB_KINDS) | frozenset(RAW_KINDS)

# Fields mlx-bun writes before ``tensors``, in its order; other extras follow it.
_BEFORE_TENSORS = (
    "kind", "offset", "idx", "maxSize", "keep", "groupSize", "bits", "kBits", "vBits",
    "headDim", "kvLoraRank", "ropeHeadDim", "dsaHeadDim", "maxTokens",
)
# Tensors with token axis 2 that mlx-bun slices to ``offset`` (and we regrow).
_TOKEN_AXIS = 2
_TENSOR_COUNT = {"kv": 2, "rotating": 2, "qkv": 6, "ssm": 2}
# What mlx-bun's codec ``load`` of each kind reads: its tensors (entry.tensors[i]!)
# and the fields it passes on with ``!``. "paged" is mlx-bun's pagedCacheCodec,
# which the reference does not show: only the generic checks apply to it.
_RAW_TENSORS = {"rotating-qkv": 6, "turboquant": 5, "mla": 2, "mla-dsa": 3, "mtp-mla": 2}
_RAW_FIELDS = {
    "rotating-qkv": ("offset", "idx", "maxSize", "groupSize", "bits"),
    "turboquant": ("offset", "kBits", "vBits", "headDim"),
    "mla": ("offset", "kvLoraRank", "ropeHeadDim"),
    "mla-dsa": ("offset", "kvLoraRank", "ropeHeadDim", "dsaHeadDim"),
    "mtp-mla": ("offset", "kvLoraRank", "ropeHeadDim"),
}
_SAFE_INT = 2**53 - 1  # Number.isSafeInteger


def _int(entry: dict[str, Any], key: str) -> int:
    v = entry.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise LayerError(f"{entry.get('kind')!r} layer: field {key!r} is {v!r}, not an int >= 0")
    return v


def _extra(entry: dict[str, Any], used: tuple[str, ...]) -> bytes:
    rest = {k: v for k, v in entry.items() if k not in used and k != "tensors"}
    return _v3json.dumps(rest) if rest else b""


@dataclass(frozen=True)
class LayerPlan:
    """How to restore one header entry: its record and each tensor's token capacity."""

    entry: dict[str, Any]
    record: Layer | None  # None for raw kinds
    capacities: tuple[int | None, ...]  # rows to allocate on axis 2, None = as stored


def minimum_reusable_offset(entry: dict[str, Any]) -> int:
    """mlx-bun's ``cacheHeaderMinimumReusableOffset``: checked for every layer it loads.

    ``minimumReusableOffset`` (default: ``offset`` for turboquant, else 0) must
    be a safe integer in ``[0, offset]``.
    """
    v: Any = entry.get("minimumReusableOffset")
    if v is None:  # `??`: absent or null
        v = entry.get("offset") if entry.get("kind") == "turboquant" else 0
    offset: Any = entry.get("offset")

    def number(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    ok = number(v) and float(v).is_integer() and 0 <= v <= _SAFE_INT
    # JS compares `offset > entry.offset` as numbers: a missing offset compares false
    if ok and number(offset) and v > offset:
        ok = False
    if not ok:
        raise LayerError(
            f"invalid cache minimum reusable offset: minimumReusableOffset {v!r} with "
            f"offset {offset!r} (needs an integer in [0, offset])"
        )
    return int(v)


def _check_raw(entry: dict[str, Any]) -> None:
    kind = entry["kind"]
    slots = entry["tensors"]
    want = _RAW_TENSORS.get(kind)
    if want is not None and len(slots) != want:
        raise LayerError(f"{kind!r} layer has {len(slots)} tensors, expected {want}")
    for key in _RAW_FIELDS.get(kind, ()):
        _int(entry, key)
    if kind == "mtp-mla" and entry.get("dsaHeadDim") is not None:
        raise LayerError(
            f"native MTP cache cannot contain DSA state (dsaHeadDim {entry['dsaHeadDim']!r})"
        )


def plan_layer(entry: dict[str, Any]) -> LayerPlan:
    """Check one header entry and decide how its tensors are restored.

    Tensor records must already be valid (``_v3io.validate_slot``).
    """
    kind = entry["kind"]
    slots = entry["tensors"]
    minimum_reusable_offset(entry)
    if kind in RAW_KINDS:
        _check_raw(entry)
        return LayerPlan(entry, None, (None,) * len(slots))
    if kind not in _TENSOR_COUNT:
        raise LayerError(f"unsupported cache kind {kind!r}")
    if len(slots) != _TENSOR_COUNT[kind]:
        raise LayerError(f"{kind!r} layer has {len(slots)} tensors, expected {_TENSOR_COUNT[kind]}")
    offset = _int(entry, "offset")
    record: Layer
    if kind == "ssm":
        # ArraysCache has no offset: it travels in kvstore_extra, in its place.
        record = ArraysLayer(size=2, present=(True, True), extra=_extra(entry, ("kind",)))
        return LayerPlan(entry, record, (None, None))
    if kind == "rotating":
        record = RotatingLayer(
            offset=offset,
            max_size=_int(entry, "maxSize"),
            idx=_int(entry, "idx"),
            keep=_int(entry, "keep") if "keep" in entry else 0,
            extra=_extra(entry, ("kind", "offset", "idx", "maxSize", "keep")),
        )
        return LayerPlan(entry, record, (None, None))
    for slot in slots:
        shape = slot["shape"]
        if len(shape) != 4 or shape[_TOKEN_AXIS] < offset:
            raise LayerError(f"{kind!r} layer: tensor shape {shape} does not hold offset {offset}")
    if kind == "kv":
        record = KVLayer(offset=offset, extra=_extra(entry, ("kind", "offset")))
    else:
        record = QuantizedLayer(
            offset=offset,
            group_size=_int(entry, "groupSize"),
            bits=_int(entry, "bits"),
            extra=_extra(entry, ("kind", "offset", "groupSize", "bits")),
        )
    want = codec_for_record(record).token_capacity(record, offset)
    caps = tuple(max(want, int(s["shape"][_TOKEN_AXIS])) for s in slots)
    return LayerPlan(entry, record, caps)


def build_layer(plan: LayerPlan, arrays: list[mx.array]) -> Any:
    """The cache object for a planned entry, from its (regrown) arrays."""
    entry = plan.entry
    if plan.record is None:
        fields = {k: v for k, v in entry.items() if k not in ("kind", "tensors")}
        return RawCache(
            source_kind=entry["kind"],
            fields=_v3json.dumps(fields),
            tensors=list(arrays),
            trimmable=RAW_KINDS[entry["kind"]](entry),
        )
    offset = int(entry["offset"])
    return codec_for_record(plan.record).load(plan.record, arrays, offset)


# --- writing -----------------------------------------------------------------


def _extras_of(record: Layer) -> dict[str, Any]:
    if not record.extra:
        return {}
    extra = _v3json.loads(record.extra)
    if not isinstance(extra, dict):
        raise CacheMismatchError(f"kvstore_extra is not a JSON object: {record.extra!r}")
    return extra


def _ordered(fields: dict[str, Any], tensors: Any) -> dict[str, Any]:
    out = {k: fields[k] for k in _BEFORE_TENSORS if k in fields}
    after = {k: v for k, v in fields.items() if k not in out}
    out["tensors"] = tensors
    out.update(after)
    return out


@dataclass(frozen=True)
class LayerOut:
    """One layer ready to write: a function placing the tensor slots, and the tensors."""

    make_entry: Callable[[list[dict[str, Any]]], dict[str, Any]]
    tensors: tuple[TensorData, ...]


def dump_layer(cache: Any, n_tokens: int) -> LayerOut:
    """The mlx-bun header fields and tensors of one cache object."""
    snap = snapshot(cache)
    rec = snap.record
    tensors = snap.tensors
    if isinstance(rec, RawLayer):
        fields = _v3json.loads(rec.fields) if rec.fields else {}
        kind = rec.source_kind

        def raw_entry(slots: list[dict[str, Any]]) -> dict[str, Any]:
            # The fields were kept in their original order; mlx-bun puts
            # minimumReusableOffset after the tensors and everything else before.
            out: dict[str, Any] = {"kind": kind}
            out.update({k: v for k, v in fields.items() if k != "minimumReusableOffset"})
            out["tensors"] = slots
            if "minimumReusableOffset" in fields:
                out["minimumReusableOffset"] = fields["minimumReusableOffset"]
            return out

        return LayerOut(raw_entry, tensors)
    extras = _extras_of(rec)
    base: dict[str, Any]
    if isinstance(rec, KVLayer):
        base = {"kind": "kv", "offset": rec.offset}
    elif isinstance(rec, RotatingLayer):
        base = {"kind": "rotating", "offset": rec.offset, "idx": rec.idx, "maxSize": rec.max_size}
        if rec.keep:
            base["keep"] = rec.keep
    elif isinstance(rec, QuantizedLayer):
        base = {"kind": "qkv", "offset": rec.offset, "groupSize": rec.group_size,
                "bits": rec.bits}
    elif (
        isinstance(rec, ArraysLayer)
        and rec.present == (True, True)
        and not rec.has_left_padding
        and not rec.has_lengths
    ):
        base = {"kind": "ssm", "offset": extras.pop("offset", n_tokens)}
    else:
        raise CacheMismatchError(
            f"{type(cache).__name__} ({type(rec).__name__}) has no mlx-bun v3 layer kind"
        )
    fields = {**base, **{k: v for k, v in extras.items() if k not in base}}
    return LayerOut(lambda slots: _ordered(fields, slots), tensors)
