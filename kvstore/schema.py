"""The manifest schema (format 5): msgspec Structs, encoded deterministically.

A manifest describes one saved entry. Its layers are a tagged union keyed by
``kind``; each layer lists its own tensors. Tensors with a token axis are cut
into token blocks, the others are concatenated into state blocks; both lists
of digests live in the manifest. The manifest is named by the digest of its
msgpack encoding.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from .errors import InvalidNamespaceError, ManifestError

FORMAT_VERSION = 5
#: A manifest whose blocks carry a salt (a tenant's, docs/FORMAT.md §3 "Salted blocks"):
#: readers before it refuse the format instead of misreading its block sizes.
SALTED_FORMAT_VERSION = 6
SALT_BYTES = 32
#: The metadata key of a salted manifest's salt (64 hex digits): every block file is its
#: tensors' bytes then the salt, so a block's name, H(bytes || salt), differs per salt.
#: In ``metadata`` rather than a field of its own, so that unsalted manifests keep their
#: exact bytes (and ids).
SALT_KEY = "kvstore.block_salt"
#: What a salted tenant's namespace holds (``<ns>#tenant-<tag>``, kvstore.store.tenants)
TENANT_MARK = "#tenant-"

@dataclass(frozen=True)
class DType:
    """One MLX dtype and what each format calls it (None: the format cannot hold it)."""

    name: str  # MLX's (``str(mx.bfloat16)`` without ``mlx.core.``), as manifests spell it
    itemsize: int
    safetensors: str | None  # the safetensors header's code (``BF16``)
    mlx_bun: str | None  # the name an mlx-bun v3/v4/v5 slot's ``dtype`` holds


#: The one dtype table: the names manifests use and their item sizes; codecs.layout
#: and formats/ derive their tables from it.
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("bool", 1, "BOOL", "bool"),
    DType("uint8", 1, "U8", "uint8"),
    DType("uint16", 2, "U16", "uint16"),
    DType("uint32", 4, "U32", "uint32"),
    DType("uint64", 8, "U64", "uint64"),
    DType("int8", 1, "I8", "int8"),
    DType("int16", 2, "I16", "int16"),
    DType("int32", 4, "I32", "int32"),
    DType("int64", 8, "I64", "int64"),
    DType("float16", 2, "F16", "float16"),
    DType("bfloat16", 2, "BF16", "bfloat16"),
    DType("float32", 4, "F32", "float32"),
    DType("float64", 8, "F64", "float64"),
    DType("complex64", 8, None, None),
)}  # fmt: skip


NonNeg = Annotated[int, Meta(ge=0)]


class Namespace(Struct, frozen=True, kw_only=True):
    """Which model, config, tokenizer and user namespace an entry belongs to."""

    model_id: str
    config_fingerprint: str = ""
    tokenizer_hash: str = ""
    ns: str = "default"

    def __post_init__(self) -> None:
        # msgspec checks types only when decoding; a Namespace built in code with
        # model_id=None would be saved and then break every listing of the root.
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidNamespaceError(
                    f"Namespace.{name} must be a str, got {type(value).__name__} {value!r}"
                )


class TensorSpec(Struct, frozen=True, kw_only=True):
    """One tensor: its shape and dtype, and where its bytes live.

    ``token_axis`` is set for tensors cut into token blocks (their length on
    that axis is the entry's token count); ``state_offset`` is the byte offset
    in the concatenated state stream for the others. ``window_start`` is set
    for a window tensor (a :class:`WindowLayer`'s): its token axis holds the
    tokens ``[window_start, n_tokens)``, and its rows go into the manifest's
    window blocks, cut at the same absolute token positions as the token blocks.
    """

    shape: tuple[NonNeg, ...]
    dtype: str
    token_axis: NonNeg | None = None
    state_offset: NonNeg | None = None
    window_start: NonNeg | None = None


class _Layer(Struct, frozen=True, kw_only=True, tag_field="kind"):
    tensors: tuple[TensorSpec, ...] = ()
    # JSON object of fields a foreign format carries that mlx-lm has no place
    # for (e.g. mlx-bun's minimumReusableOffset); written back unchanged.
    extra: bytes = b""


class KVLayer(_Layer, frozen=True, kw_only=True, tag="kv"):
    offset: NonNeg


class RotatingLayer(_Layer, frozen=True, kw_only=True, tag="rotating"):
    offset: NonNeg
    max_size: NonNeg
    keep: NonNeg = 0
    idx: NonNeg = 0


class WindowLayer(_Layer, frozen=True, kw_only=True, tag="window"):
    """A sliding-window layer (``RotatingKVCache``, ``keep=0``) stored in token order.

    Its keys and values hold the tokens ``[window_start, offset)`` unrolled from
    the ring (their specs carry ``window_start``), so consecutive saves of one
    prompt share every whole block of their overlapping windows. ``idx`` is the
    ring position mlx-lm had: a restore rolls the rows back into that ring.
    """

    offset: NonNeg
    max_size: NonNeg
    idx: NonNeg = 0


class QuantizedLayer(_Layer, frozen=True, kw_only=True, tag="qkv"):
    offset: NonNeg
    group_size: NonNeg
    bits: NonNeg


class ChunkedLayer(_Layer, frozen=True, kw_only=True, tag="chunked"):
    offset: NonNeg
    chunk_size: NonNeg
    start_position: NonNeg = 0


class ArraysLayer(_Layer, frozen=True, kw_only=True, tag="arrays"):
    """ArraysCache (and subclasses such as MambaCache): fixed-size state slots."""

    cls: str = "ArraysCache"
    size: NonNeg
    present: tuple[bool, ...]  # which slots hold an array (None otherwise)
    has_left_padding: bool = False
    has_lengths: bool = False


class ListLayer(_Layer, frozen=True, kw_only=True, tag="list"):
    """CacheList: nested caches; their tensors follow depth-first."""

    children: tuple[Layer, ...]


class RawLayer(_Layer, frozen=True, kw_only=True, tag="raw"):
    """A foreign cache kind with no mlx-lm class, kept losslessly.

    ``source_kind`` is the foreign kind name (``mla``, ``paged``, …) and
    ``fields`` the JSON object of its non-tensor fields, in original key order.
    ``trimmable`` says whether a prefix of it can be served.
    """

    source_kind: str
    fields: bytes = b"{}"
    trimmable: bool = False


Layer = (
    KVLayer
    | RotatingLayer
    | WindowLayer
    | QuantizedLayer
    | ChunkedLayer
    | ArraysLayer
    | ListLayer
    | RawLayer
)


class Attachment(Struct, frozen=True, kw_only=True):
    """Extra tensors saved with an entry (mlx-bun v4 attachments)."""

    schema: str
    metadata: bytes = b"{}"  # JSON object, original key order
    tensors: tuple[TensorSpec, ...] = ()


class Manifest(Struct, frozen=True, kw_only=True):
    """One saved entry. Tokens are packed u32 little-endian."""

    format: int = FORMAT_VERSION
    namespace: Namespace
    codec: str
    hash: str
    block_tokens: NonNeg
    state_block_bytes: NonNeg
    created_at: NonNeg  # ms since the epoch
    n_tokens: NonNeg
    tokens: bytes
    layers: tuple[Layer, ...]
    token_blocks: tuple[bytes, ...] = ()
    state_blocks: tuple[bytes, ...] = ()
    state_bytes: NonNeg = 0
    attachments: tuple[Attachment, ...] = ()
    metadata: dict[str, str] = {}
    # The window tensors' blocks: the i-th holds absolute token block
    # ``first + i`` (``first``: the lowest window_start // block_tokens).
    window_blocks: tuple[bytes, ...] = ()

    def tensor_specs(self) -> list[TensorSpec]:
        """Every tensor the entry stores, in block order: the layers', then the attachments'."""
        return iter_tensor_specs(self.layers) + [t for a in self.attachments for t in a.tensors]

    @property
    def block_salt(self) -> bytes:
        """The salt every block file of this entry ends with (``b""``: none)."""
        return bytes.fromhex(self.metadata.get(SALT_KEY, ""))

    def all_blocks(self) -> tuple[bytes, ...]:
        """Every block reference in order (token, window, state blocks), repeats kept."""
        return (*self.token_blocks, *self.window_blocks, *self.state_blocks)

    def block_digests(self) -> list[bytes]:
        """Every block the entry references, once each, token blocks first."""
        return list(dict.fromkeys(bytes(d) for d in self.all_blocks()))


def block_salt(namespace: Namespace) -> bytes:
    """The salt every block of a tenant's entries ends with (docs/FORMAT.md §3, "Salted
    blocks"): SHA-256 of a domain string and the tenant's namespace; ``b""`` for a
    namespace that is no tenant's (its blocks are named by their bytes alone, shared by
    every entry that holds them). So two tenants that store the same prompt write two
    sets of blocks: neither the names nor the bytes written, nor ``/metrics``, say
    whether another tenant stored it."""
    if TENANT_MARK not in namespace.ns:
        return b""
    return hashlib.sha256(b"kvstore block salt v1\0" + namespace.ns.encode()).digest()


_encoder = msgspec.msgpack.Encoder(order="deterministic")
_decoder = msgspec.msgpack.Decoder(Manifest)


def encode_manifest(m: Manifest) -> bytes:
    """The deterministic msgpack encoding (what the manifest digest is taken of)."""
    return _encoder.encode(m)


def decode_manifest(
    data: bytes | memoryview,
    *,
    hash: str | None = None,
    block_tokens: int | None = None,
    state_block_bytes: int | None = None,
) -> Manifest:
    """Decode and validate (:func:`validate_manifest`); anything wrong is a
    :class:`ManifestError`. The keyword arguments, when given, are the settings of the
    root or remote the manifest was read from, which it must share."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes (at most {MAX_MANIFEST_BYTES})")
    try:
        m = _decoder.decode(data)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ManifestError(f"cannot decode manifest: {e}") from e
    except RecursionError:  # msgspec's own depth guard: layers nested past any real cache
        raise ManifestError("cannot decode manifest: nested too deep") from None
    validate_manifest(m, hash=hash, block_tokens=block_tokens,
                      state_block_bytes=state_block_bytes)
    return m


def iter_tensor_specs(layers: tuple[Layer, ...]) -> list[TensorSpec]:
    """Every tensor of the layers, depth-first, in manifest order."""
    out: list[TensorSpec] = []
    for layer in layers:
        out.extend(layer.tensors)
        if isinstance(layer, ListLayer):
            out.extend(iter_tensor_specs(layer.children))
    return out


# --- validation ------------------------------------------------------------------------
# A manifest is read from a root or a bucket that may lie. Every count and size it
# claims is bounded, and checked against the others, before anything is allocated,
# read or deleted because of it (docs/FORMAT.md, "Manifests"). The bounds are far
# above any real cache and low enough that what they admit can be handled.

MAX_MANIFEST_BYTES = 64 << 20  # an encoded manifest (8M tokens are 32 MiB of it)
MAX_TOKENS = 1 << 23  # tokens of one entry
MAX_BLOCK_TOKENS = 1 << 16
MAX_STATE_BLOCK_BYTES = 1 << 30
MAX_LAYERS = 1 << 14  # layer records, the children of list layers included
MAX_DEPTH = 8  # list layers inside list layers
MAX_TENSORS = 1 << 16
MAX_NDIM = 8
MAX_BLOCK_BYTES = 1 << 32  # one token block
MAX_ENTRY_BYTES = 1 << 42  # every tensor of an entry
MAX_COUNT = 1 << 32  # offsets, sizes and positions inside a layer record
MAX_TEXT = 4096  # characters of a name: namespace fields, codec, hash, dtype, class
MAX_BLOB = 1 << 20  # bytes of a JSON blob (extra, fields, attachment metadata)
MAX_METADATA = 256  # metadata items
MAX_ATTACHMENTS = 256
MAX_TIME_MS = 253402300799999  # 9999-12-31T23:59:59.999Z
DIGEST_BYTES = 32
QUANT_BITS = range(1, 9)


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ManifestError(f"invalid manifest: {what}")


def _text(value: str, what: str) -> None:
    _need(len(value) <= MAX_TEXT, f"{what} is {len(value)} chars (at most {MAX_TEXT})")


def _blob(value: bytes, what: str) -> None:
    _need(len(value) <= MAX_BLOB, f"{what} is {len(value)} bytes (at most {MAX_BLOB})")


def _count(value: int, what: str, top: int = MAX_COUNT) -> None:
    _need(value <= top, f"{what} {value} (at most {top})")


def _layer_fields(layer: _Layer, where: str) -> None:
    """The bounds of one layer record's own fields (its tensors are checked apart)."""
    _blob(layer.extra, f"{where}.extra")
    if isinstance(layer, KVLayer | QuantizedLayer | ChunkedLayer | RotatingLayer | WindowLayer):
        _count(layer.offset, f"{where}.offset")
    if isinstance(layer, QuantizedLayer):
        _need(layer.bits in QUANT_BITS, f"{where}.bits {layer.bits} (1 to 8)")
        _need(1 <= layer.group_size <= 4096, f"{where}.group_size {layer.group_size}")
    elif isinstance(layer, RotatingLayer):
        _count(layer.max_size, f"{where}.max_size")
        _count(layer.idx, f"{where}.idx")  # past max_size while a prefill's buffer grows
        _need(layer.keep <= layer.max_size,
              f"{where}: keep {layer.keep} must be <= max_size {layer.max_size}")
    elif isinstance(layer, WindowLayer):
        _need(1 <= layer.max_size <= MAX_COUNT, f"{where}.max_size {layer.max_size}")
        _count(layer.idx, f"{where}.idx")
    elif isinstance(layer, ChunkedLayer):
        _count(layer.chunk_size, f"{where}.chunk_size")
        _count(layer.start_position, f"{where}.start_position")
    elif isinstance(layer, ArraysLayer):
        _text(layer.cls, f"{where}.cls")
        _need(len(layer.present) == layer.size <= 1024,
              f"{where}: size {layer.size} with {len(layer.present)} slots")
    elif isinstance(layer, RawLayer):
        _text(layer.source_kind, f"{where}.source_kind")
        _blob(layer.fields, f"{where}.fields")


def _walk_layers(layers: tuple[Layer, ...]) -> int:
    """Check every layer record, depth first without recursion; returns how many."""
    seen = 0
    stack: list[tuple[tuple[Layer, ...], int, str]] = [(layers, 1, "layers")]
    while stack:
        group, depth, where = stack.pop()
        _need(depth <= MAX_DEPTH, f"{where}: list layers nested deeper than {MAX_DEPTH}")
        seen += len(group)
        _need(seen <= MAX_LAYERS, f"more than {MAX_LAYERS} layer records")
        for i, layer in enumerate(group):
            _layer_fields(layer, f"{where}[{i}]")
            if not isinstance(layer, WindowLayer):
                _need(all(t.window_start is None for t in layer.tensors),
                      f"{where}[{i}]: a window tensor outside a window layer")
            if isinstance(layer, ListLayer):
                stack.append((layer.children, depth + 1, f"{where}[{i}].children"))
    return seen


def _window_layer(layer: WindowLayer, n_tokens: int, where: str) -> None:
    """The window rule (a ``keep=0`` ring stored in token order, as
    ``RotatingCodec.stored`` writes it): its keys and values, two window tensors from one
    ``window_start``, hold the tokens ``[window_start, n_tokens)``; the layer ends at the
    entry's end (``offset == n_tokens``); the rows are the whole window, ``min(n_tokens,
    max_size)`` at least, and no more than the ring mlx-lm had: in token order with ``idx``
    at their end (``max_size - 1`` plus a prefill chunk at most, every token if the ring
    never wrapped), or exactly ``max_size`` rows wrapped at ``0 < idx < max_size``."""
    n, w = n_tokens, layer.max_size
    _need(layer.offset == n, f"{where}: window layer at offset {layer.offset}, the entry "
          f"has {n} tokens")
    _need(len(layer.tensors) == 2, f"{where}: {len(layer.tensors)} tensors, a window layer "
          "has keys and values")
    starts = {t.window_start for t in layer.tensors}
    axes = {t.token_axis for t in layer.tensors}
    _need(len(starts) == 1 and None not in starts and len(axes) == 1 and None not in axes,
          f"{where}: keys and values are not window tensors from one token")
    start, axis = starts.pop(), axes.pop()
    assert start is not None and axis is not None
    _need(start < n, f"{where}: window from token {start} of {n}")
    rows = n - start
    _need(rows >= min(n, w), f"{where}: a window of {rows} rows, max_size {w} needs "
          f"{min(n, w)}")
    wrapped = rows == w and 0 < layer.idx < w and n > w
    _need(layer.idx == rows or wrapped,
          f"{where}: ring position {layer.idx} with {rows} rows of max_size {w}")
    for t in layer.tensors:
        _need(axis < len(t.shape) and t.shape[axis] == rows,
              f"{where}: a window tensor {list(t.shape)[:MAX_NDIM]} does not hold tokens "
              f"[{start}, {n})")


def _windows(layers: tuple[Layer, ...], n_tokens: int) -> None:
    """Check every window layer (:func:`_window_layer`), list layers' children too (their
    depth is bounded by :func:`_walk_layers`, which runs first)."""
    stack: list[tuple[tuple[Layer, ...], str]] = [(layers, "layers")]
    while stack:
        group, where = stack.pop()
        for i, layer in enumerate(group):
            if isinstance(layer, WindowLayer):
                _window_layer(layer, n_tokens, f"{where}[{i}]")
            elif isinstance(layer, ListLayer):
                stack.append((layer.children, f"{where}[{i}].children"))


def _tensors(m: Manifest) -> tuple[bool, int, int, int]:
    """Check every tensor spec against the manifest; returns (any token tensor, the
    bytes of one token row of all token tensors together, the same of the window
    tensors, the first absolute token block of the windows)."""
    specs = m.tensor_specs()
    _need(len(specs) <= MAX_TENSORS, f"{len(specs)} tensors (at most {MAX_TENSORS})")
    state_at = 0
    row_bytes = 0
    window_row_bytes = 0
    window_from: int | None = None
    has_token = False
    total = 0
    for i, t in enumerate(specs):
        where = f"tensor {i}"
        dt = DTYPES.get(t.dtype)
        _need(dt is not None, f"{where}: unknown dtype {t.dtype[:64]!r}")
        assert dt is not None
        _need(len(t.shape) <= MAX_NDIM, f"{where}: {len(t.shape)} dimensions")
        nbytes = math.prod(t.shape) * dt.itemsize
        total += nbytes
        _need(total <= MAX_ENTRY_BYTES, f"tensors of more than {MAX_ENTRY_BYTES} bytes")
        if t.window_start is not None:  # a window layer's: checked by _window_layer
            _need(t.token_axis is not None and t.state_offset is None,
                  f"{where}: a window tensor without a token axis of its own")
            _need(t.window_start < m.n_tokens,
                  f"{where}: window from token {t.window_start} of {m.n_tokens}")
            window_row_bytes += nbytes // (m.n_tokens - t.window_start)
            window_from = min(t.window_start, window_from if window_from is not None
                              else t.window_start)
        elif t.token_axis is not None:
            _need(t.state_offset is None, f"{where}: both a token axis and a state offset")
            _need(t.token_axis < len(t.shape),
                  f"{where}: token axis {t.token_axis} of a {len(t.shape)}-d tensor")
            _need(t.shape[t.token_axis] == m.n_tokens,
                  f"{where}: {t.shape[t.token_axis]} tokens on its token axis, the entry "
                  f"has {m.n_tokens}")
            has_token = True
            row_bytes += nbytes // m.n_tokens
        else:
            _need(t.state_offset == state_at,
                  f"{where}: state offset {t.state_offset}, expected {state_at}")
            state_at += nbytes
    _need(state_at == m.state_bytes,
          f"state_bytes {m.state_bytes}, its state tensors hold {state_at}")
    first = -1 if window_from is None else window_from // m.block_tokens
    return has_token, row_bytes, window_row_bytes, first


def validate_manifest(
    m: Manifest,
    *,
    hash: str | None = None,
    block_tokens: int | None = None,
    state_block_bytes: int | None = None,
) -> None:
    """Check a decoded manifest's every field against its bounds and the other fields:
    a :class:`ManifestError` names the first that is wrong. Nothing is allocated in
    proportion to what the manifest claims before the claim is checked."""
    if SALT_KEY in m.metadata:
        salt = m.metadata[SALT_KEY]
        _need(m.format == SALTED_FORMAT_VERSION, f"format {m.format} with a block salt, "
              f"expected {SALTED_FORMAT_VERSION}")
        _need(len(salt) == 2 * SALT_BYTES and all(c in "0123456789abcdef" for c in salt),
              f"block salt {salt[:80]!r}: {2 * SALT_BYTES} lowercase hex digits expected")
    else:
        _need(m.format == FORMAT_VERSION, f"format {m.format}, expected {FORMAT_VERSION}")
    for name in m.namespace.__struct_fields__:
        _text(getattr(m.namespace, name), f"namespace.{name}")
    _text(m.codec, "codec")
    _need(len(m.hash) <= 16, "hash name too long")
    for name, want in (("hash", hash), ("block_tokens", block_tokens),
                       ("state_block_bytes", state_block_bytes)):
        if want is not None:
            _need(getattr(m, name) == want, f"{name} {getattr(m, name)!r}, this store's is "
                  f"{want!r}")
    _need(1 <= m.block_tokens <= MAX_BLOCK_TOKENS,
          f"block_tokens {m.block_tokens} (1 to {MAX_BLOCK_TOKENS})")
    _need(1 <= m.state_block_bytes <= MAX_STATE_BLOCK_BYTES,
          f"state_block_bytes {m.state_block_bytes} (1 to {MAX_STATE_BLOCK_BYTES})")
    _count(m.created_at, "created_at", MAX_TIME_MS)
    _need(1 <= m.n_tokens <= MAX_TOKENS, f"n_tokens {m.n_tokens} (1 to {MAX_TOKENS})")
    _need(len(m.tokens) == 4 * m.n_tokens,
          f"{len(m.tokens)} bytes of tokens for n_tokens {m.n_tokens}")
    _need(len(m.attachments) <= MAX_ATTACHMENTS, f"{len(m.attachments)} attachments")
    for i, a in enumerate(m.attachments):
        _text(a.schema, f"attachments[{i}].schema")
        _blob(a.metadata, f"attachments[{i}].metadata")
    _need(len(m.metadata) <= MAX_METADATA, f"{len(m.metadata)} metadata items")
    _need(sum(len(k) + len(v) for k, v in m.metadata.items()) <= MAX_BLOB,
          "metadata too large")
    _walk_layers(m.layers)
    for i, a in enumerate(m.attachments):
        _need(all(t.window_start is None for t in a.tensors),
              f"attachments[{i}]: a window tensor outside a window layer")
    _windows(m.layers, m.n_tokens)
    has_token, row_bytes, window_row_bytes, window_first = _tensors(m)
    n_blocks = -(-m.n_tokens // m.block_tokens)
    want_token = n_blocks if has_token else 0
    # window blocks hold absolute token blocks, from the one the earliest window starts in
    want_window = n_blocks - window_first if window_first >= 0 else 0
    want_state = -(-m.state_bytes // m.state_block_bytes)
    _need((len(m.token_blocks), len(m.window_blocks), len(m.state_blocks))
          == (want_token, want_window, want_state),
          f"{len(m.token_blocks)}+{len(m.window_blocks)}+{len(m.state_blocks)} token+window+"
          f"state blocks listed, its tensors need {want_token}+{want_window}+{want_state}")
    _need(max(row_bytes, window_row_bytes) * min(m.block_tokens, m.n_tokens) <= MAX_BLOCK_BYTES,
          f"token blocks of more than {MAX_BLOCK_BYTES} bytes")
    for d in m.all_blocks():
        _need(len(d) == DIGEST_BYTES, f"a block digest of {len(d)} bytes")
