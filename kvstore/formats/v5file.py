"""mlx-bun's v5 header file: the v3 header with per-tensor ``blocks: [{hash, bytes}]``.

The file holds only the prefix, the header and zero padding to dataStart; each
tensor's bytes are the concatenation of its blocks, stored as
``<dir of file>/blocks/<sha256 hex>``. Block names are validated before any
path is built. This is an import/export format; the store keeps its own layout.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import os
import re
import stat
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._vio import ShortReadError, preadv_all, pwritev_all
from ..codecs.base import AttachmentData
from ..codecs.pieces import cut
from ..errors import CacheMismatchError
from ..schema import Namespace
from . import _v3json
from ._frame import PREFIX_LEN, align_up, atomic_file, check_target, encode_prefix, plan_file
from ._v3io import PieceSource, tensor_pieces, validate_slot
from .bunhash import bun_hash_pieces_hex
from .errors import BlockFileTypeError, BlockReferenceError, CorruptFileBlockError

__all__ = ["DEFAULT_BLOCK_BYTES", "BlockFiles", "block_refs", "block_source", "save_v5"]

DEFAULT_BLOCK_BYTES = 32768
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # fullmatch, as JS /^...$/ (no final newline)
#: Block files open at once while reading one v5 file (mlx-lm lowers the soft
#: RLIMIT_NOFILE to 2048; a 2560-token entry has more blocks than that).
MAX_OPEN_BLOCKS = 16
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_FILE_TYPES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def open_block(path: str, where: str, digest: str, file: Path, size: int) -> int:
    """An fd on a block that is a regular file of ``size`` bytes, else a typed error.

    Opened with O_NOFOLLOW (a symlink is refused, its target never read) and
    O_NONBLOCK (a FIFO does not hang the open), then checked with fstat.
    """
    try:
        fd = os.open(file, _OPEN_FLAGS)
    except FileNotFoundError:
        raise BlockReferenceError(path, f"{where}: block file {file} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BlockFileTypeError(
                path, f"{where}: block {digest} is a symlink, not a regular file"
            ) from None
        raise BlockReferenceError(path, f"{where}: block {digest}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = next((w for test, w in _FILE_TYPES if test(st.st_mode)), "not a regular file")
            raise BlockFileTypeError(path, f"{where}: block {digest} is {what}, not a regular file")
        if st.st_size != size:
            raise BlockReferenceError(
                path, f"{where}: block {digest} is {st.st_size} bytes, header says {size}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


class BlockFiles:
    """The block fds of one read: at most :data:`MAX_OPEN_BLOCKS` open, least recent closed."""

    def __init__(self, limit: int = MAX_OPEN_BLOCKS) -> None:
        self.limit = limit
        self._fds: OrderedDict[Path, int] = OrderedDict()

    def fd(self, path: str, where: str, digest: str, file: Path, size: int) -> int:
        """An open, checked fd on ``file``."""
        fd = self._fds.get(file)
        if fd is not None:
            self._fds.move_to_end(file)
            return fd
        while len(self._fds) >= self.limit:
            os.close(self._fds.popitem(last=False)[1])
        fd = open_block(path, where, digest, file, size)
        self._fds[file] = fd
        return fd

    def close(self) -> None:
        """Close every fd still open."""
        while self._fds:
            os.close(self._fds.popitem()[1])


class BlockRange(PieceSource):
    """A tensor's bytes gathered from its block files."""

    def __init__(
        self, path: str, where: str, files: list[tuple[str, Path, int]],
        fds: BlockFiles | None = None,
    ) -> None:
        self.path, self.where, self.files = path, where, files
        self.fds = fds if fds is not None else BlockFiles()
        self.starts: list[int] = []
        total = 0
        for _, _, n in files:
            self.starts.append(total)
            total += n
        self.stored_len = total
        self._sha = [hashlib.sha256() for _ in files]
        self._next = [0] * len(files)

    def _fd(self, i: int) -> int:
        digest, file, n = self.files[i]
        return self.fds.fd(self.path, self.where, digest, file, n)

    def _pread(self, i: int, dst: memoryview, within: int) -> None:
        try:
            preadv_all(self._fd(i), [dst], within)
        except ShortReadError:
            raise BlockReferenceError(
                self.path, f"{self.where}: block {self.files[i][0]} ended early"
            ) from None

    def readinto(self, dst: memoryview, at: int) -> None:
        while dst.nbytes:
            i = bisect.bisect_right(self.starts, at) - 1
            within = at - self.starts[i]
            k = min(dst.nbytes, self.files[i][2] - within)
            piece = dst[:k]
            self._pread(i, piece, within)
            if within == self._next[i]:
                self._sha[i].update(piece)
                self._next[i] += k
            dst, at = dst[k:], at + k

    def verify(self, verify: bool) -> None:
        if not verify:
            return
        for i, (digest, file, n) in enumerate(self.files):
            if self._next[i] != n:  # not read in order: hash the block again
                self._sha[i] = hashlib.sha256()
                buf = memoryview(bytearray(min(n, 1 << 20)))
                for at in range(0, n, buf.nbytes):
                    piece = buf[: min(buf.nbytes, n - at)]
                    self._pread(i, piece, at)
                    self._sha[i].update(piece)
            got = self._sha[i].hexdigest()
            if got != digest:
                raise CorruptFileBlockError(
                    self.path, f"{self.where}: KV block mismatch: block {digest} hashes to {got}",
                    digest, got, block_path=str(file),
                )

    def close(self) -> None:
        self.fds.close()


def block_refs(path: str, slot: dict[str, Any], where: str) -> list[tuple[str, int]]:
    """A v5 slot's block list as ``(sha256 hex, bytes)``, checked as mlx-bun's reader does.

    Reads no file. A missing list is an empty one (``slot.blocks ?? []``), so it
    only fits a zero-byte tensor.
    """
    nbytes = validate_slot(path, slot, where, v5=True)
    blocks = slot.get("blocks")
    if blocks is None:
        blocks = []
    if not isinstance(blocks, list):
        raise BlockReferenceError(path, f"{where}: v5 tensor's 'blocks' is not a list")
    refs: list[tuple[str, int]] = []
    total = 0
    for b in blocks:
        digest = b.get("hash") if isinstance(b, dict) else None
        size = b.get("bytes") if isinstance(b, dict) else None
        if (not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest)
                or not isinstance(size, int) or isinstance(size, bool) or size <= 0
                or total + size > nbytes):
            shown = repr(b) if len(repr(b)) <= 120 else repr(b)[:117] + "..."
            raise BlockReferenceError(
                path, f"{where}: invalid KV block reference {shown} "
                f"({total} of the tensor's {nbytes} bytes before it)"
            )
        refs.append((digest, size))
        total += size
    if total != nbytes:
        raise BlockReferenceError(
            path, f"{where}: blocks hold {total} bytes, tensor needs {nbytes}"
        )
    return refs


def block_source(
    path: str, slot: dict[str, Any], where: str, fds: BlockFiles | None = None
) -> BlockRange:
    """Check a v5 slot's block list against the block files beside ``path``.

    Each block must be a regular file (not a symlink, FIFO or directory) of the
    listed size; it is opened to check, then closed (reads reopen through ``fds``).
    """
    root = Path(path).parent / "blocks"
    files: list[tuple[str, Path, int]] = []
    for digest, size in block_refs(path, slot, where):
        file = root / digest
        os.close(open_block(path, where, digest, file, size))
        files.append((digest, file, size))
    return BlockRange(path, where, files, fds)


def _write_block(root: Path, pieces: list[memoryview]) -> tuple[str, int]:
    sha = hashlib.sha256()
    for p in pieces:
        sha.update(p)
    digest = sha.hexdigest()
    target = root / digest
    n = sum(p.nbytes for p in pieces)
    if target.exists():  # content-addressed: never rewritten
        return digest, n
    with atomic_file(target, sync_dir=False) as fd:  # the header file's write syncs the dirs
        pwritev_all(fd, pieces, 0)
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
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a v5 header file and its SHA-256 blocks in ``<dir>/blocks/``.

    Tensor ``off`` values are the v3 layout's (mlx-bun's reader ignores them);
    ``hash`` is each tensor's Bun.hash, as in v3. ``metadata`` is kept as in
    :func:`~kvstore.formats.v3.save_v3`.
    """
    if not cache:
        raise CacheMismatchError("nothing to save: the cache list is empty")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, not {block_bytes}")
    check_target(path)  # before any block is written beside it
    planned = plan_file(tokens, cache, version=5, namespace=namespace,
                        attachments=attachments, created_at=created_at, metadata=metadata)
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
        pwritev_all(fd, [memoryview(encode_prefix(header_json))], 0)
