"""mlx-bun's v5 header file: the v3 header with per-tensor ``blocks: [{hash, bytes}]``.

The file holds only the prefix, the header and zero padding to dataStart; each
tensor's bytes are the concatenation of its blocks, stored as
``<dir of file>/blocks/<sha256 hex>``. Block names are validated before any
path is built. This is an import/export format; the store keeps its own layout.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..codecs._pieces import cut
from ..codecs.base import AttachmentData
from ..errors import BlockReferenceError, CacheMismatchError, TensorHashMismatchError
from ..schema import Namespace
from . import _v3json
from ._v3io import PieceSource, tensor_pieces, validate_slot
from .bunhash import bun_hash_pieces_hex
from .v3 import PREFIX_LEN, align_up, atomic_file, encode_prefix, plan_file, pwrite_all

__all__ = ["DEFAULT_BLOCK_BYTES", "block_source", "save_v5"]

DEFAULT_BLOCK_BYTES = 32768
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class BlockRange(PieceSource):
    """A tensor's bytes gathered from its block files."""

    def __init__(self, path: str, where: str, files: list[tuple[str, Path, int]]) -> None:
        self.path, self.where, self.files = path, where, files
        self.starts: list[int] = []
        total = 0
        for _, _, n in files:
            self.starts.append(total)
            total += n
        self.stored_len = total
        self._fds: dict[int, int] = {}
        self._sha = [hashlib.sha256() for _ in files]
        self._next = [0] * len(files)

    def _fd(self, i: int) -> int:
        if i not in self._fds:
            self._fds[i] = os.open(self.files[i][1], os.O_RDONLY)
        return self._fds[i]

    def readinto(self, dst: memoryview, at: int) -> None:
        import bisect

        while dst.nbytes:
            i = bisect.bisect_right(self.starts, at) - 1
            within = at - self.starts[i]
            k = min(dst.nbytes, self.files[i][2] - within)
            piece = dst[:k]
            got = os.preadv(self._fd(i), [piece], within)
            if got != k:
                raise BlockReferenceError(
                    self.path, f"{self.where}: block {self.files[i][0]} ended early"
                )
            if within == self._next[i]:
                self._sha[i].update(piece)
                self._next[i] += k
            dst, at = dst[k:], at + k

    def verify(self, verify: bool) -> None:
        if not verify:
            return
        for i, (digest, file, n) in enumerate(self.files):
            if self._next[i] != n:  # not read in order: hash the file again
                self._sha[i] = hashlib.sha256(file.read_bytes())
            got = self._sha[i].hexdigest()
            if got != digest:
                raise TensorHashMismatchError(
                    self.path, f"{self.where}: KV block mismatch: block {digest} hashes to {got}",
                    digest, got,
                )

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def block_source(path: str, slot: dict[str, Any], where: str) -> BlockRange:
    """Check a v5 slot's block list against the block files beside ``path``."""
    nbytes = validate_slot(path, slot, where)
    blocks = slot.get("blocks")
    if not isinstance(blocks, list):
        raise BlockReferenceError(path, f"{where}: v5 tensor has no 'blocks' list")
    root = Path(path).parent / "blocks"
    files: list[tuple[str, Path, int]] = []
    total = 0
    for b in blocks:
        digest = b.get("hash") if isinstance(b, dict) else None
        size = b.get("bytes") if isinstance(b, dict) else None
        if (not isinstance(digest, str) or not _SHA256_HEX.match(digest)
                or not isinstance(size, int) or isinstance(size, bool) or size <= 0
                or total + size > nbytes):
            raise BlockReferenceError(path, f"{where}: invalid KV block reference {b!r}")
        file = root / digest
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            raise BlockReferenceError(path, f"{where}: block file {file} is missing") from None
        if actual != size:
            raise BlockReferenceError(
                path, f"{where}: block {digest} is {actual} bytes, header says {size}"
            )
        files.append((digest, file, size))
        total += size
    if total != nbytes:
        raise BlockReferenceError(
            path, f"{where}: blocks hold {total} bytes, tensor needs {nbytes}"
        )
    return BlockRange(path, where, files)


def _write_block(root: Path, pieces: list[memoryview]) -> tuple[str, int]:
    sha = hashlib.sha256()
    for p in pieces:
        sha.update(p)
    digest = sha.hexdigest()
    target = root / digest
    n = sum(p.nbytes for p in pieces)
    if target.exists():  # content-addressed: never rewritten
        return digest, n
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{digest[:16]}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        pwrite_all(fd, pieces, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, target)
    return digest, n


def save_v5(
    path: str | os.PathLike[str],
    tokens: Sequence[int],
    cache: Sequence[Any],
    *,
    namespace: Namespace | None = None,
    attachments: Sequence[AttachmentData] | None = None,
    created_at: int | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> None:
    """Write a v5 header file and its SHA-256 blocks in ``<dir>/blocks/``.

    Tensor ``off`` values are the v3 layout's (mlx-bun's reader ignores them);
    ``hash`` is each tensor's Bun.hash, as in v3.
    """
    if not cache:
        raise CacheMismatchError("nothing to save: the cache list is empty")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, not {block_bytes}")
    planned = plan_file(tokens, cache, version=5, namespace=namespace,
                        attachments=attachments, created_at=created_at)
    root = Path(path).parent / "blocks"
    root.mkdir(parents=True, exist_ok=True)
    for slot, t in planned.items:
        pieces = tensor_pieces(t)
        slot["hash"] = bun_hash_pieces_hex(pieces)
        slot["blocks"] = [
            {"hash": d, "bytes": n}
            for d, n in (_write_block(root, group) for group in cut(pieces, block_bytes))
        ]
    header_json = _v3json.dumps(planned.header)
    assert align_up(PREFIX_LEN + len(header_json)) == len(encode_prefix(header_json))
    with atomic_file(path) as fd:
        pwrite_all(fd, [memoryview(encode_prefix(header_json))], 0)
