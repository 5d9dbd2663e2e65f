"""mlx-bun's monolithic cache file (formatVersion 3, 4 with attachments, 5 read here).

Layout: magic ``MLXBUNKV2\\n``, u32 LE header length, u32 LE dataStart, u64 LE
Bun.hash of the header, the JSON header, zero padding to dataStart (aligned to
16 KiB), then each tensor at ``dataStart + off``. The header hash is always
checked; per-tensor hashes (v5: block SHA-256) only with ``verify=True``.

Bytes enter MLX in one copy: :func:`mx.load` reads a small synthetic
safetensors stream whose ``readinto`` fills each fresh array straight from the
file (or v5 block files), regrowing KV tensors to their step capacity on the
way. Bytes leave MLX without a copy: each tensor's memoryview, cut into the
live rows, goes to ``os.pwritev``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._vio import pwritev_all
from ..codecs.base import AttachmentData
from ..errors import CacheMismatchError
from ..schema import Namespace
from . import _v3json
from ._frame import (
    ALIGN,
    CODEC_PROVIDER,
    MAGIC,
    NS_FIELDS,
    PREFIX_LEN,
    align_up,
    atomic_file,
    check_target,
    encode_prefix,
    plan_file,
)
from ._frame import HASH_PLACEHOLDER as HASH_PLACEHOLDER
from ._v3io import (
    PieceSource,
    TensorPlan,
    check_allocation,
    check_overlaps,
    check_slot,
    load_arrays,
    tensor_pieces,
    validate_slot,
)
from ._v3kinds import KNOWN_KINDS, LayerPlan, build_layer, plan_layer
from .bunhash import bun_hash, bun_hash_pieces_hex
from .errors import (
    BadMagicError,
    CodecProviderMismatchError,
    FileDigestMismatchError,
    HeaderFieldError,
    LayerError,
    MalformedHeaderError,
    NamespaceMismatchError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from .v5file import BlockFiles, block_refs, block_source

__all__ = [
    "ALIGN",
    "CODEC_PROVIDER",
    "HeaderInfo",
    "Loaded",
    "MAGIC",
    "check_header",
    "load_v3",
    "read_header",
    "save_v3",
    "v5_blocks",
]

SUPPORTED_VERSIONS = (3, 4, 5)


@dataclass(frozen=True)
class HeaderInfo:
    """A file's prefix fields and parsed JSON header (no tensor data read)."""

    path: str
    header_len: int
    data_start: int
    header_hash: int
    header: dict[str, Any]
    file_size: int

    @property
    def format_version(self) -> int:
        """The header's ``formatVersion`` (3, 4 or 5)."""
        return int(self.header["formatVersion"])

    @property
    def header_hash_hex(self) -> str:
        """The prefix's header hash as 16 lowercase hex chars."""
        return f"{self.header_hash:016x}"


@dataclass
class Loaded:
    """What :func:`load_v3` restores: tokens, header, one cache object per layer."""

    tokens: list[int]
    header: dict[str, Any]
    cache: list[Any]
    attachments: list[AttachmentData] = field(default_factory=list)
    format_version: int = 3

    @property
    def namespace(self) -> Namespace | None:
        """The header's identity fields as a Namespace (None without a modelId)."""
        h = self.header
        if not isinstance(h.get("modelId"), str):
            return None
        return Namespace(
            model_id=h["modelId"],
            config_fingerprint=str(h.get("configFingerprint", "")),
            tokenizer_hash=str(h.get("tokenizerHash", "")),
            ns=str(h.get("ns", "default")),
        )


# --- reading -----------------------------------------------------------------


def _read_exact(fd: int, n: int, at: int, path: str, what: str) -> bytes:
    data = os.pread(fd, n, at)
    if len(data) != n:
        raise TruncatedFileError(path, f"file ends at byte {at + len(data)}, inside the {what}")
    return data


def _header_from_fd(fd: int, path: str) -> HeaderInfo:
    size = os.fstat(fd).st_size
    head = os.pread(fd, PREFIX_LEN, 0)
    if head[: len(MAGIC)] != MAGIC[: len(head)] or len(head) < len(MAGIC):
        if len(head) < len(MAGIC) and MAGIC.startswith(head):
            raise TruncatedFileError(path, f"file is {len(head)} bytes, shorter than the magic")
        raise BadMagicError(path, f"bad magic {head[:len(MAGIC)]!r}, not an mlx-bun KV file")
    if len(head) < PREFIX_LEN:
        raise TruncatedFileError(path, f"file is {len(head)} bytes, shorter than its prefix")
    header_len, data_start, expect = struct.unpack_from("<IIQ", head, len(MAGIC))
    if PREFIX_LEN + header_len > size:  # checked before the read allocates up to 4 GiB
        raise TruncatedFileError(
            path, f"header length {header_len} runs past the end of the file: header would end "
            f"at byte {PREFIX_LEN + header_len}, file is {size} bytes"
        )
    body = _read_exact(fd, header_len, PREFIX_LEN, path, f"{header_len}-byte header")
    got = bun_hash(body)
    if got != expect:
        raise FileDigestMismatchError(
            path, f"header hash mismatch: prefix says {expect:016x}, header hashes to {got:016x}",
            f"{expect:016x}", f"{got:016x}",
        )
    try:
        header = _v3json.loads(body)
    except ValueError as e:  # UnicodeDecodeError and nesting too deep included
        raise MalformedHeaderError(path, f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise MalformedHeaderError(
            path, f"header is a JSON {type(header).__name__}, not an object"
        )
    version = header.get("formatVersion")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise UnsupportedVersionError(
            path, f"unsupported formatVersion {version!r} (reads 3, 4 and 5)"
        )
    if data_start < PREFIX_LEN + header_len:
        raise HeaderFieldError(
            path,
            f"dataStart {data_start} lies inside the header (ends at {PREFIX_LEN + header_len})",
        )
    return HeaderInfo(path, header_len, data_start, expect, header, size)


def read_header(path: str | os.PathLike[str]) -> HeaderInfo:
    """The prefix and the hash-checked JSON header of a v3/v4/v5 file."""
    p = os.fspath(path)
    fd = os.open(p, os.O_RDONLY)
    try:
        return _header_from_fd(fd, p)
    finally:
        os.close(fd)


def attachments_of(header: dict[str, Any]) -> list[Any]:
    """The header's attachments (``header.attachments ?? []``, as mlx-bun reads them)."""
    atts = header.get("attachments")
    return [] if atts is None else atts


def _check_structure(info: HeaderInfo) -> None:
    path, h = info.path, info.header
    tokens = h.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise HeaderFieldError(path, "header field 'tokens' is not a list of ints")
    caches = h.get("caches")
    if not isinstance(caches, list):
        raise HeaderFieldError(
            path, f"header field 'caches' is {type(caches).__name__}, not a list"
        )
    if not caches:  # mlx-bun compares the count with the model's layers (never 0)
        raise HeaderFieldError(path, "header field 'caches' lists no cache layers")
    for i, e in enumerate(caches):
        if not isinstance(e, dict) or not isinstance(e.get("kind"), str):
            raise HeaderFieldError(path, f"cache layer {i} has no 'kind'")
        if e["kind"] not in KNOWN_KINDS:
            raise HeaderFieldError(
                path, f"cache layer {i}: unsupported cache kind {e['kind'][:80]!r}"
            )
        if not isinstance(e.get("tensors"), list):
            raise HeaderFieldError(path, f"cache layer {i} ({e['kind']}) has no 'tensors' list")
    atts = attachments_of(h)
    if not isinstance(atts, list):
        raise HeaderFieldError(
            path, f"header field 'attachments' is {type(atts).__name__}, not a list"
        )
    for i, a in enumerate(atts):
        if not isinstance(a, dict) or not isinstance(a.get("schema"), str) \
                or not isinstance(a.get("tensors"), list):
            raise HeaderFieldError(
                path, f"attachment {i} is not an object with a 'schema' string and a "
                f"'tensors' list"
            )


@dataclass(frozen=True)
class CheckedHeader:
    """A header that passed every check mlx-bun's reader makes before reading tensors."""

    layers: list[LayerPlan]
    tensors: list[TensorPlan]  # layers' tensors in order, then attachments' (no source yet)


class _Unread(PieceSource):
    """The placeholder source of a checked tensor, until :func:`load_v3` opens it."""

    def __init__(self, n: int) -> None:
        self.stored_len = n


def check_header(info: HeaderInfo, *, verify: bool = False) -> CheckedHeader:
    """Every header check of mlx-bun's ``readKvHeader`` and ``loadKvCache``, no data read.

    The table of those checks and where each is mirrored:

    ==========================================  ==========================================
    persistence.ts                              here
    ==========================================  ==========================================
    magic ``MLXBUNKV2\\n``                       ``_header_from_fd`` (BadMagicError)
    body of headerLen read, Bun.hash == prefix  ``_header_from_fd`` (Truncated-,
                                                FileDigestMismatchError), length vs file
                                                size checked first
    JSON.parse (UTF-8 TextDecoder)              ``_v3json.loads`` (MalformedHeaderError):
                                                NaN/Infinity, non-UTF-8, too deep refused
    formatVersion in 3, 4, 5                    ``_header_from_fd`` (UnsupportedVersion-)
    codecProvider ?? mlx-cache-v3               ``_check_identity`` (CodecProviderMismatch-)
    modelId/config/tokenizer/ns vs expected     ``_check_identity`` (NamespaceMismatch-)
    caches.length == model's layers (>= 1)      ``_check_structure``: not empty
    codecs.forHeader: known kind                ``_check_structure`` (HeaderFieldError)
    minimumReusableOffset safe int in [0, off]  ``_v3kinds.minimum_reusable_offset``
    codec.load: tensors[i]!, fields with ``!``  ``_v3kinds.plan_layer`` / ``_check_raw``
    mtp-mla has no dsaHeadDim; GLM counts       ``_v3kinds._check_raw``
    kv: [B, H, S, D], grown to step capacity    ``plan_layer`` (S >= offset), TensorPlan
    attachments ?? [], .tensors.map             ``_check_structure``
    v3: mmap view of dataStart+off, bytes       ``check_slot`` (Truncated-/OutOfBounds-)
    fromBytesCopy(bytes, shape, dtype)          ``validate_slot``: dtype, bytes == shape,
                                                <= 64 dims, dims < 2**31
    verify: hash64(view) == slot.hash           ``TensorPlan.check_hash``
    v5: blocks ?? [], hash /^[a-f0-9]{64}$/,    ``v5file.block_refs`` (BlockReferenceError)
    bytes > 0, running sum <= slot.bytes,
    sum == slot.bytes
    v5: block read, length == bytes             ``v5file.open_block`` (regular file only)
    v5 verify: sha256(block) == hash            ``BlockRange.verify``
    ==========================================  ==========================================

    Beyond mlx-bun (hostile files): tensors of a v3/v4 file must not overlap,
    the allocation is bounded (``_v3io.check_allocation``), a zero-size tensor
    has one dimension, and dataStart lies after the header.
    """
    _check_structure(info)
    p, h = info.path, info.header
    v5 = info.format_version == 5
    layers: list[LayerPlan] = []
    tensors: list[TensorPlan] = []
    ranges: list[tuple[int, int, str]] = []

    def add(slot: Any, what: str, cap: int | None) -> None:
        if v5:
            n = sum(size for _, size in block_refs(p, slot, what))
        else:
            n = validate_slot(p, slot, what)
            check_slot(p, slot, what, info.data_start, info.file_size)
            start = info.data_start + int(slot["off"])
            ranges.append((start, start + n, what))
        tensors.append(TensorPlan.make(p, slot, what, _Unread(n), cap, verify and not v5))

    for i, entry in enumerate(h["caches"]):
        where = f"cache layer {i} ({entry['kind']})"
        for j, slot in enumerate(entry["tensors"]):
            validate_slot(p, slot, f"{where} tensor {j}", v5=v5)
        try:
            plan = plan_layer(entry)
        except LayerError as e:
            raise HeaderFieldError(p, f"{where}: {e}") from None
        layers.append(plan)
        for j, (slot, cap) in enumerate(zip(entry["tensors"], plan.capacities, strict=True)):
            add(slot, f"{where} tensor {j}", cap)
    for i, att in enumerate(attachments_of(h)):
        for j, slot in enumerate(att["tensors"]):
            add(slot, f"attachment {i} ({att['schema'][:80]}) tensor {j}", None)
    check_overlaps(p, ranges)
    stored = sum(t.source.stored_len for t in tensors) if v5 else info.file_size
    check_allocation(p, tensors, stored)
    return CheckedHeader(layers, tensors)


def _check_identity(info: HeaderInfo, namespace: Namespace | None) -> None:
    h = info.header
    provider = h.get("codecProvider")
    if provider is None:  # `header.codecProvider ?? legacyCacheCodecs.id`
        provider = CODEC_PROVIDER
    if provider != CODEC_PROVIDER:
        raise CodecProviderMismatchError(
            info.path,
            f"cache codec provider mismatch: file {provider!r}, expected {CODEC_PROVIDER!r}",
        )
    if namespace is None:
        return
    for key, attr in NS_FIELDS:
        want = getattr(namespace, attr)
        got = h.get(key, "" if want == "" else None)
        if got != want:
            raise NamespaceMismatchError(
                info.path, f"{key} mismatch (file {got!r}, expected {want!r})"
            )


def v5_blocks(path: str | os.PathLike[str]) -> dict[str, int]:
    """The block files a v5 file names, ``{sha256 hex: bytes}`` (each once), from its
    checked header; reads no block."""
    info = read_header(path)
    if info.format_version != 5:
        return {}
    out: dict[str, int] = {}
    for t in check_header(info).tensors:
        out.update(block_refs(info.path, t.slot, t.where))
    return out


def load_v3(
    path: str | os.PathLike[str], *, verify: bool = False, namespace: Namespace | None = None
) -> Loaded:
    """Read an mlx-bun v3/v4/v5 file into mlx-lm cache objects (or :class:`RawCache`).

    Raises a :class:`FileFormatError` subclass naming the file and the problem;
    every header check (:func:`check_header`) runs before anything is allocated.
    """
    p = os.fspath(path)
    fd = os.open(p, os.O_RDONLY)
    try:
        info = _header_from_fd(fd, p)
        checked = check_header(info, verify=verify)
        _check_identity(info, namespace)
        h = info.header
        plans = checked.layers
        tensors = checked.tensors
        if info.format_version == 5:
            fds = BlockFiles()  # shared: a bounded number of block fds open at once
            for t in tensors:
                t.source = block_source(p, t.slot, t.where, fds)
        else:
            for t in tensors:
                t.source = check_slot(p, t.slot, t.where, info.data_start, info.file_size)
        arrays = load_arrays(p, fd, tensors, verify)
    finally:
        os.close(fd)

    it = iter(arrays)
    cache = []
    for i, plan in enumerate(plans):
        layer_arrays = [next(it) for _ in plan.entry["tensors"]]
        try:
            cache.append(build_layer(plan, layer_arrays))
        except (ValueError, TypeError, KeyError) as e:
            raise HeaderFieldError(p, f"cache layer {i} ({plan.entry['kind']}): {e}") from e
    attachments = [
        AttachmentData(
            schema=a["schema"],
            metadata=_v3json.dumps(a.get("metadata", {})),
            tensors=tuple(next(it) for _ in a["tensors"]),
        )
        for a in attachments_of(h)
    ]
    return Loaded(
        tokens=list(h["tokens"]),
        header=h,
        cache=cache,
        attachments=attachments,
        format_version=info.format_version,
    )


# --- writing -----------------------------------------------------------------


pwrite_all = pwritev_all  # the name this module has always had for it


def save_v3(
    path: str | os.PathLike[str],
    tokens: Sequence[int],
    cache: Sequence[Any],
    *,
    namespace: Namespace | None = None,
    attachments: Sequence[AttachmentData] | None = None,
    created_at: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write an mlx-bun v3 file (v4 with attachments), atomically, one tensor at a time.

    ``created_at`` is milliseconds since the epoch (now when None); ``metadata``
    string pairs are kept in the header (see :func:`plan_file`).
    """
    if not cache:
        raise CacheMismatchError("nothing to save: the cache list is empty")
    check_target(path)
    version = 4 if attachments else 3
    planned = plan_file(tokens, cache, version=version, namespace=namespace,
                        attachments=attachments, created_at=created_at, metadata=metadata)
    header_len = len(_v3json.dumps(planned.header))
    data_start = align_up(PREFIX_LEN + header_len)
    with atomic_file(path) as fd:
        for slot, t in planned.items:
            pieces = tensor_pieces(t)
            slot["hash"] = bun_hash_pieces_hex(pieces)
            pwritev_all(fd, pieces, data_start + slot["off"])
            del pieces
        header_json = _v3json.dumps(planned.header)
        if len(header_json) != header_len:
            raise AssertionError("header length changed while writing")  # hashes are fixed-width
        pwritev_all(fd, [memoryview(encode_prefix(header_json))], 0)
