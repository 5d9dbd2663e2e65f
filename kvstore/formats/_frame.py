"""The frame mlx-bun's v3, v4 and v5 files share, and how one is written.

The prefix (magic ``MLXBUNKV2\\n``, u32 LE header length, u32 LE dataStart,
u64 LE Bun.hash of the header), the 16 KiB alignment, the header's layout of
tensor slots as mlx-bun's ``planKvCache`` makes it, and the atomic file write
(temp file, fsync, rename) that :mod:`~kvstore.formats.v3` and
:mod:`~kvstore.formats.v5file` both use. Neither imports the other for these.
"""

from __future__ import annotations

import errno
import os
import struct
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._vio import full_fsync
from ..codecs.base import AttachmentData, TensorData
from ..schema import Namespace
from . import _v3json
from ._v3io import dtype_of
from ._v3kinds import dump_layer
from .bunhash import bun_hash

__all__ = [
    "ALIGN",
    "CODEC_PROVIDER",
    "HASH_PLACEHOLDER",
    "MAGIC",
    "NS_FIELDS",
    "PREFIX_LEN",
    "Planned",
    "align_up",
    "atomic_file",
    "check_target",
    "encode_prefix",
    "plan_file",
]

MAGIC = b"MLXBUNKV2\n"
ALIGN = 16384
PREFIX_LEN = len(MAGIC) + 4 + 4 + 8
CODEC_PROVIDER = "mlx-cache-v3"
HASH_PLACEHOLDER = "0" * 16
NS_FIELDS = (
    ("modelId", "model_id"),
    ("configFingerprint", "config_fingerprint"),
    ("tokenizerHash", "tokenizer_hash"),
    ("ns", "ns"),
)


def align_up(n: int) -> int:
    """``n`` rounded up to the 16 KiB tensor alignment."""
    return -(-n // ALIGN) * ALIGN


@dataclass
class Planned:
    """A planned file: the header (with placeholder hashes) and each tensor beside its slot."""

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
    metadata: Mapping[str, str] | None = None,
) -> Planned:
    """Lay out header and tensors exactly as mlx-bun's ``planKvCache`` does.

    ``metadata`` (string pairs, e.g. mlx-lm's ``cache_type``) goes into a header
    field ``metadata`` of its own, which mlx-bun's reader ignores; none when empty.
    """
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
        for key, attr in NS_FIELDS:
            header[key] = getattr(namespace, attr)
    if metadata:
        header["metadata"] = {k: metadata[k] for k in sorted(metadata)}
    if att_out:
        header["attachments"] = att_out
    header["codecProvider"] = CODEC_PROVIDER
    header["tokens"] = toks
    header["caches"] = entries
    return Planned(header, items)


def encode_prefix(header_json: bytes) -> bytes:
    """Magic, lengths, header hash, header and zero padding up to dataStart."""
    data_start = align_up(PREFIX_LEN + len(header_json))
    pre = bytearray(data_start)
    pre[: len(MAGIC)] = MAGIC
    struct.pack_into("<IIQ", pre, len(MAGIC), len(header_json), data_start, bun_hash(header_json))
    pre[PREFIX_LEN : PREFIX_LEN + len(header_json)] = header_json
    return bytes(pre)


def check_target(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path, refused before any work when it names a directory or its
    directory does not exist (the error names that directory, not a temp file in it)."""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file to write", str(target))
    parent = target.parent
    if not parent.is_dir():
        what = "not a directory" if parent.exists() else "no such directory"
        raise FileNotFoundError(errno.ENOENT, what, str(parent))
    return target


@contextmanager
def atomic_file(path: str | os.PathLike[str], *, sync_dir: bool = True) -> Iterator[int]:
    """A temp file beside ``path``: fsync'd and renamed over it when the block succeeds.

    ``sync_dir`` also fsyncs the directory, so the rename itself is durable; the
    v5 blocks, written many to a directory, leave that to the header file's write.
    """
    target = check_target(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        yield fd
        full_fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, target)
    except BaseException:  # a directory made there meanwhile, say: leave nothing beside it
        os.unlink(tmp)
        raise
    if not sync_dir:
        return
    dfd = os.open(target.parent, os.O_RDONLY)
    try:
        full_fsync(dfd)
    finally:
        os.close(dfd)
