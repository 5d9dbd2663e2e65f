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
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..codecs.base import AttachmentData, TensorData
from ..errors import (
    BadMagicError,
    CacheMismatchError,
    CodecProviderMismatchError,
    FileFormatError,
    HeaderHashMismatchError,
    NamespaceMismatchError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from ..schema import Namespace
from . import _v3json
from ._v3io import (
    PieceSource,
    TensorPlan,
    check_slot,
    dtype_of,
    load_arrays,
    tensor_pieces,
)
from ._v3kinds import KNOWN_KINDS, LayerError, build_layer, dump_layer, plan_layer
from .bunhash import bun_hash, bun_hash_pieces_hex

__all__ = [
    "ALIGN",
    "CODEC_PROVIDER",
    "HeaderInfo",
    "Loaded",
    "MAGIC",
    "load_v3",
    "read_header",
    "save_v3",
]

MAGIC = b"MLXBUNKV2\n"
ALIGN = 16384
PREFIX_LEN = len(MAGIC) + 4 + 4 + 8
CODEC_PROVIDER = "mlx-cache-v3"
SUPPORTED_VERSIONS = (3, 4, 5)
HASH_PLACEHOLDER = "0" * 16
_NS_FIELDS = (
    ("modelId", "model_id"),
    ("configFingerprint", "config_fingerprint"),
    ("tokenizerHash", "tokenizer_hash"),
    ("ns", "ns"),
)


def align_up(n: int) -> int:
    """``n`` rounded up to the 16 KiB tensor alignment."""
    return -(-n // ALIGN) * ALIGN


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
    body = _read_exact(fd, header_len, PREFIX_LEN, path, f"{header_len}-byte header")
    got = bun_hash(body)
    if got != expect:
        raise HeaderHashMismatchError(
            path, f"header hash mismatch: prefix says {expect:016x}, header hashes to {got:016x}"
        )
    try:
        header = _v3json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise FileFormatError(path, f"header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise FileFormatError(path, "header is not a JSON object")
    version = header.get("formatVersion")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise UnsupportedVersionError(
            path, f"unsupported formatVersion {version!r} (reads 3, 4 and 5)"
        )
    if data_start < PREFIX_LEN + header_len:
        raise FileFormatError(
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


def _check_structure(info: HeaderInfo) -> None:
    path, h = info.path, info.header
    tokens = h.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise FileFormatError(path, "header field 'tokens' is not a list of ints")
    caches = h.get("caches")
    if not isinstance(caches, list):
        raise FileFormatError(path, "header field 'caches' is not a list")
    for i, e in enumerate(caches):
        if not isinstance(e, dict) or not isinstance(e.get("kind"), str):
            raise FileFormatError(path, f"cache layer {i} has no 'kind'")
        if e["kind"] not in KNOWN_KINDS:
            raise FileFormatError(path, f"cache layer {i}: unsupported cache kind {e['kind']!r}")
        if not isinstance(e.get("tensors"), list):
            raise FileFormatError(path, f"cache layer {i} ({e['kind']}) has no 'tensors' list")
    atts = h.get("attachments", [])
    if not isinstance(atts, list) or not all(
        isinstance(a, dict) and isinstance(a.get("schema"), str)
        and isinstance(a.get("tensors"), list) for a in atts
    ):
        raise FileFormatError(path, "header field 'attachments' is malformed")


def _check_identity(info: HeaderInfo, namespace: Namespace | None) -> None:
    h = info.header
    provider = h.get("codecProvider", CODEC_PROVIDER)
    if provider != CODEC_PROVIDER:
        raise CodecProviderMismatchError(
            info.path,
            f"cache codec provider mismatch: file {provider!r}, expected {CODEC_PROVIDER!r}",
        )
    if namespace is None:
        return
    for key, attr in _NS_FIELDS:
        want = getattr(namespace, attr)
        got = h.get(key, "" if want == "" else None)
        if got != want:
            raise NamespaceMismatchError(
                info.path, f"{key} mismatch (file {got!r}, expected {want!r})"
            )


def _tensor_source(info: HeaderInfo, slot: dict[str, Any], where: str) -> PieceSource:
    if info.format_version == 5:
        from .v5file import block_source

        return block_source(info.path, slot, where)
    return check_slot(info.path, slot, where, info.data_start, info.file_size)


def load_v3(
    path: str | os.PathLike[str], *, verify: bool = False, namespace: Namespace | None = None
) -> Loaded:
    """Read an mlx-bun v3/v4/v5 file into mlx-lm cache objects (or :class:`RawCache`).

    Raises a :class:`FileFormatError` subclass naming the file and the problem.
    """
    p = os.fspath(path)
    fd = os.open(p, os.O_RDONLY)
    try:
        info = _header_from_fd(fd, p)
        _check_structure(info)
        _check_identity(info, namespace)
        h = info.header
        plans = []
        tensors: list[TensorPlan] = []
        for i, entry in enumerate(h["caches"]):
            where = f"cache layer {i} ({entry['kind']})"
            try:
                plan = plan_layer(entry)
            except LayerError as e:
                raise FileFormatError(p, f"{where}: {e}") from None
            plans.append(plan)
            for j, (slot, cap) in enumerate(zip(entry["tensors"], plan.capacities, strict=True)):
                what = f"{where} tensor {j}"
                tensors.append(TensorPlan.make(
                    p, slot, what, _tensor_source(info, slot, what),
                    cap, verify and info.format_version != 5,
                ))
        for i, att in enumerate(h.get("attachments", [])):
            for j, slot in enumerate(att["tensors"]):
                where = f"attachment {i} ({att['schema']}) tensor {j}"
                tensors.append(TensorPlan.make(
                    p, slot, where, _tensor_source(info, slot, where), None,
                    verify and info.format_version != 5,
                ))
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
            raise FileFormatError(p, f"cache layer {i} ({plan.entry['kind']}): {e}") from e
    attachments = [
        AttachmentData(
            schema=a["schema"],
            metadata=_v3json.dumps(a.get("metadata", {})),
            tensors=tuple(next(it) for _ in a["tensors"]),
        )
        for a in h.get("attachments", [])
    ]
    return Loaded(
        tokens=list(h["tokens"]),
        header=h,
        cache=cache,
        attachments=attachments,
        format_version=info.format_version,
    )


# --- writing -----------------------------------------------------------------


@dataclass
class _Planned:
    """The header (with placeholder hashes) and each tensor beside its slot."""

    header: dict[str, Any]
    items: list[tuple[dict[str, Any], TensorData]]


def _slot(t: TensorData, off: int) -> dict[str, Any]:
    shape = list(t.shape)
    nbytes = t.array.itemsize
    for d in shape:
        nbytes *= d
    return {"off": off, "bytes": nbytes, "shape": shape, "dtype": dtype_of(t.array),
            "hash": HASH_PLACEHOLDER}


def plan_file(
    tokens: Sequence[int],
    cache: Sequence[Any],
    *,
    version: int,
    namespace: Namespace | None,
    attachments: Sequence[AttachmentData] | None,
    created_at: int | None,
) -> _Planned:
    """Lay out header and tensors exactly as mlx-bun's ``planKvCache`` does."""
    toks = [int(t) for t in tokens]
    items: list[tuple[dict[str, Any], TensorData]] = []
    entries = []
    cursor = 0
    for layer in cache:
        out = dump_layer(layer, len(toks))
        slots = []
        for t in out.tensors:
            s = _slot(t, align_up(cursor))
            cursor = s["off"] + s["bytes"]
            slots.append(s)
            items.append((s, t))
        entries.append(out.make_entry(slots))
    att_out = []
    for a in attachments or ():
        slots = []
        for arr in a.tensors:
            # mlx-bun places an attachment tensor at the cursor, then aligns.
            s = _slot(TensorData(arr), cursor)
            cursor = align_up(cursor + s["bytes"])
            slots.append(s)
            items.append((s, TensorData(arr)))
        att_out.append({"schema": a.schema, "metadata": _v3json.RawJSON(a.metadata or b"{}"),
                        "tensors": slots})
    header: dict[str, Any] = {
        "formatVersion": version,
        "createdAt": int(time.time() * 1000) if created_at is None else int(created_at),
    }
    if namespace is not None:
        for key, attr in _NS_FIELDS:
            header[key] = getattr(namespace, attr)
    if att_out:
        header["attachments"] = att_out
    header["codecProvider"] = CODEC_PROVIDER
    header["tokens"] = toks
    header["caches"] = entries
    return _Planned(header, items)


def encode_prefix(header_json: bytes) -> bytes:
    """Magic, lengths, header hash, header and zero padding up to dataStart."""
    data_start = align_up(PREFIX_LEN + len(header_json))
    pre = bytearray(data_start)
    pre[: len(MAGIC)] = MAGIC
    struct.pack_into("<IIQ", pre, len(MAGIC), len(header_json), data_start, bun_hash(header_json))
    pre[PREFIX_LEN : PREFIX_LEN + len(header_json)] = header_json
    return bytes(pre)


def pwrite_all(fd: int, pieces: Sequence[memoryview], at: int) -> None:
    """Write every piece, in order, from file offset ``at`` (short writes retried)."""
    iov_max = 512
    queue = [p for p in pieces if p.nbytes]
    while queue:
        batch = queue[:iov_max]
        n = os.pwritev(fd, batch, at)
        at += n
        while batch and n >= batch[0].nbytes:
            n -= batch[0].nbytes
            batch.pop(0)
            queue.pop(0)
        if n:
            queue[0] = queue[0][n:]


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[int]:
    """A temp file beside ``path``: fsync'd and renamed over it when the block succeeds."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        yield fd
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, target)
    dfd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save_v3(
    path: str | os.PathLike[str],
    tokens: Sequence[int],
    cache: Sequence[Any],
    *,
    namespace: Namespace | None = None,
    attachments: Sequence[AttachmentData] | None = None,
    created_at: int | None = None,
) -> None:
    """Write an mlx-bun v3 file (v4 with attachments), atomically, one tensor at a time.

    ``created_at`` is milliseconds since the epoch (now when None).
    """
    if not cache:
        raise CacheMismatchError("nothing to save: the cache list is empty")
    version = 4 if attachments else 3
    planned = plan_file(tokens, cache, version=version, namespace=namespace,
                        attachments=attachments, created_at=created_at)
    header_len = len(_v3json.dumps(planned.header))
    data_start = align_up(PREFIX_LEN + header_len)
    with atomic_file(path) as fd:
        for slot, t in planned.items:
            pieces = tensor_pieces(t)
            slot["hash"] = bun_hash_pieces_hex(pieces)
            pwrite_all(fd, pieces, data_start + slot["off"])
            del pieces
        header_json = _v3json.dumps(planned.header)
        if len(header_json) != header_len:
            raise AssertionError("header length changed while writing")  # hashes are fixed-width
        pwrite_all(fd, [memoryview(encode_prefix(header_json))], 0)
