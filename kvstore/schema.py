"""The manifest schema (format 5): msgspec Structs, encoded deterministically.

A manifest describes one saved entry. Its layers are a tagged union keyed by
``kind``; each layer lists its own tensors. Tensors with a token axis are cut
into token blocks, the others are concatenated into state blocks; both lists
of digests live in the manifest. The manifest is named by the digest of its
msgpack encoding.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from .errors import InvalidNamespaceError, ManifestError

FORMAT_VERSION = 5

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

    def all_blocks(self) -> tuple[bytes, ...]:
        """Every block reference in order (token, window, state blocks), repeats kept."""
        return (*self.token_blocks, *self.window_blocks, *self.state_blocks)

    def block_digests(self) -> list[bytes]:
        """Every block the entry references, once each, token blocks first."""
        return list(dict.fromkeys(bytes(d) for d in self.all_blocks()))


_encoder = msgspec.msgpack.Encoder(order="deterministic")
_decoder = msgspec.msgpack.Decoder(Manifest)


def encode_manifest(m: Manifest) -> bytes:
    """The deterministic msgpack encoding (what the manifest digest is taken of)."""
    return _encoder.encode(m)


def decode_manifest(data: bytes) -> Manifest:
    """Decode and validate; a bad encoding is a :class:`ManifestError`."""
    try:
        m = _decoder.decode(data)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ManifestError(f"cannot decode manifest: {e}") from e
    if m.format != FORMAT_VERSION:
        raise ManifestError(f"manifest format {m.format}, expected {FORMAT_VERSION}")
    return m


def iter_tensor_specs(layers: tuple[Layer, ...]) -> list[TensorSpec]:
    """Every tensor of the layers, depth-first, in manifest order."""
    out: list[TensorSpec] = []
    for layer in layers:
        out.extend(layer.tensors)
        if isinstance(layer, ListLayer):
            out.extend(iter_tensor_specs(layer.children))
    return out
