"""Tensor bytes between cache files and MLX, in one copy each way.

Reading: :func:`load_arrays` hands :func:`mx.load` a synthetic safetensors
stream; MLX allocates each array and asks the stream to ``readinto`` it, and
the stream fills it from the file (``os.preadv``) or from v5 block files,
inserting the zero rows that regrow a KV tensor to its step capacity. Tensor
hashes are computed on the bytes as they pass, in order.

Writing: :func:`tensor_pieces` gives the memoryviews of an evaluated array's
live rows, ready for ``os.pwritev`` and for hashing piece by piece.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .._vio import ShortReadError, preadv_all
from ..codecs.base import TensorData
from ..codecs.layout import MLX_BUN_DTYPES
from ..codecs.mxload import TensorStream, load_tensors
from ..schema import DTYPES
from .bunhash import BunHasher
from .errors import (
    AllocationBoundError,
    FileDigestMismatchError,
    FileFormatError,
    HeaderFieldError,
    TensorOutOfBoundsError,
    TensorOverlapError,
    TensorShapeError,
    TensorShapeMismatchError,
    TruncatedFileError,
)

_HEX16 = re.compile(r"[0-9a-f]{16}")  # fullmatch: Python's `$` would allow a final newline
MAX_NDIM = 64  # MLX's limit on dimensions
MAX_DIM = 2**31 - 1  # MLX holds shapes as int32: a larger dim is silently truncated
#: Capacity rounding: a KV tensor regrows by at most one step of rows (mlx-lm's
#: KVCache.step); the allocation bound allows this many rows per regrown tensor.
REGROW_ROWS = 256
_ZEROS = bytes(1 << 16)
_BOUNCE = 1 << 20


def dtype_of(arr: mx.array) -> str:
    """The dtype name mlx-bun writes (``bfloat16``, ``uint32``, …)."""
    name = str(arr.dtype).rsplit(".", 1)[-1]
    bun = DTYPES[name].mlx_bun if name in DTYPES else None
    if bun is None:
        raise TypeError(f"dtype {name} cannot be stored in an mlx-bun file")
    return bun


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def validate_slot(path: str, slot: Any, where: str, *, v5: bool = False) -> int:
    """Check a tensor slot's fields; returns its byte count.

    ``off`` is required in v3/v4 only (mlx-bun's v5 reader ignores it).
    """
    if not isinstance(slot, dict):
        raise HeaderFieldError(
            path, f"{where}: tensor record is {type(slot).__name__} {_short(slot)}, not an object"
        )
    shape, dtype, nbytes = slot.get("shape"), slot.get("dtype"), slot.get("bytes")
    off = slot.get("off", 0) if v5 else slot.get("off")
    if not _nonneg_int(off) or not _nonneg_int(nbytes):
        raise HeaderFieldError(
            path, f"{where}: 'off' {_short(off)} / 'bytes' {_short(nbytes)} are not ints >= 0"
        )
    if not isinstance(shape, list) or not all(_nonneg_int(d) for d in shape):
        raise HeaderFieldError(path, f"{where}: shape {_short(shape)} is not a list of ints >= 0")
    if len(shape) > MAX_NDIM:
        raise TensorShapeError(
            path, f"{where}: shape has {len(shape)} dimensions, MLX holds at most {MAX_NDIM}"
        )
    big = [d for d in shape if d > MAX_DIM]
    if big:
        raise TensorShapeError(
            path, f"{where}: shape {_short(shape)} has dimension {big[0]} >= 2**31 "
            f"(MLX would truncate it)"
        )
    if dtype not in MLX_BUN_DTYPES:
        raise HeaderFieldError(path, f"{where}: unsupported dtype {_short(dtype)}")
    want = MLX_BUN_DTYPES[dtype].itemsize
    for d in shape:
        want *= d
    if want == 0 and len(shape) > 1:
        raise TensorShapeError(
            path, f"{where}: shape {shape} is zero-size with {len(shape)} dimensions "
            f"(no mlx-bun cache tensor is empty)"
        )
    if want != nbytes:
        raise TensorShapeMismatchError(
            path, f"{where}: {nbytes} bytes, but shape {shape} of {dtype} needs {want}"
        )
    return int(nbytes)


def _short(v: Any, limit: int = 80) -> str:
    """``repr(v)`` cut to ``limit`` characters (hostile headers hold huge values)."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


class PieceSource:
    """Where one tensor's stored bytes come from."""

    stored_len: int

    def readinto(self, dst: memoryview, at: int) -> None:
        """Fill all of ``dst`` with stored bytes ``[at, at + len(dst))``."""
        raise NotImplementedError

    def verify(self, verify: bool) -> None:
        """Check content digests the source itself knows of (v5 blocks)."""

    def close(self) -> None:
        """Release file descriptors."""


class FileRange(PieceSource):
    """A tensor stored contiguously in the monolithic file."""

    def __init__(self, path: str, fd: int, base: int, length: int) -> None:
        self.path, self.fd, self.base, self.stored_len = path, fd, base, length

    def readinto(self, dst: memoryview, at: int) -> None:
        try:
            preadv_all(self.fd, [dst], self.base + at)
        except ShortReadError as e:
            raise TruncatedFileError(
                self.path, f"file ends at byte {e.offset + e.got}, inside a tensor"
            ) from None


def check_slot(
    path: str, slot: dict[str, Any], where: str, data_start: int, file_size: int
) -> PieceSource:
    """A v3/v4 tensor's byte range, checked against the file's size."""
    nbytes = validate_slot(path, slot, where)
    start = data_start + int(slot["off"])
    end = start + nbytes
    if end > file_size:
        if start < file_size:
            raise TruncatedFileError(
                path,
                f"{where}: file is {file_size} bytes, truncated inside the tensor at "
                f"[{start}, {end})",
            )
        raise TensorOutOfBoundsError(
            path, f"{where}: tensor at [{start}, {end}) lies outside the file ({file_size} bytes)"
        )
    return FileRange(path, -1, start, nbytes)


def check_overlaps(path: str, ranges: Sequence[tuple[int, int, str]]) -> None:
    """Refuse two non-empty ``(start, end, where)`` byte ranges that overlap.

    mlx-bun's writer places each tensor after the previous one; records that
    share bytes would make a small file restore as many times its size.
    """
    prev: tuple[int, int, str] | None = None
    for r in sorted((r for r in ranges if r[1] > r[0]), key=lambda r: (r[0], r[1])):
        if prev is not None and r[0] < prev[1]:
            raise TensorOverlapError(
                path, f"{r[2]}: bytes [{r[0]}, {r[1]}) overlap {prev[2]} at [{prev[0]}, {prev[1]})"
            )
        if prev is None or r[1] > prev[1]:
            prev = r


def check_allocation(path: str, plans: Sequence[TensorPlan], stored_limit: int) -> None:
    """Bound what restoring allocates, before anything is allocated.

    The bound is ``stored_limit`` (the file's size for v3/v4, the sum of the
    tensors' block bytes for v5) plus, for each KV tensor regrown to its step
    capacity, at most :data:`REGROW_ROWS` rows of that tensor.
    """
    total = sum(p.nbytes for p in plans)
    margin = sum(p.source.stored_len // p.run * REGROW_ROWS * p.row_bytes
                 for p in plans if p.gap)
    if total > stored_limit + margin:
        worst = max(plans, key=lambda p: p.nbytes)
        raise AllocationBoundError(
            path, f"restoring needs {total} bytes, more than the {stored_limit} stored bytes "
            f"plus {margin} bytes of capacity rounding; largest is {worst.where} "
            f"({worst.nbytes} bytes)"
        )


@dataclass
class TensorPlan:
    """One tensor to restore: its slot, source, and the shape MLX allocates."""

    path: str
    slot: dict[str, Any]
    where: str
    source: PieceSource
    shape: list[int]  # as allocated (token axis regrown)
    run: int  # stored bytes per outer row
    gap: int  # zero bytes after each run (0: stored as is)
    hash_expected: str | None
    hasher: BunHasher | None = None
    row_bytes: int = 0  # bytes of one token row (regrown tensors only)
    next_stored: int = 0
    in_order: bool = True

    @classmethod
    def make(
        cls,
        path: str,
        slot: dict[str, Any],
        where: str,
        source: PieceSource,
        capacity: int | None,
        verify_hash: bool,
    ) -> TensorPlan:
        """Plan ``slot``; ``capacity`` regrows axis 2 of a ``[B, H, S, D]`` tensor."""
        shape = list(slot["shape"])
        nbytes = int(slot["bytes"])
        run, gap, inner = nbytes, 0, 0
        if capacity is not None and capacity > shape[2] and nbytes:
            if capacity - shape[2] > REGROW_ROWS:
                raise AllocationBoundError(
                    path, f"{where}: regrowing {shape[2]} rows to {capacity} adds more than "
                    f"{REGROW_ROWS} rows"
                )
            if capacity > MAX_DIM:
                raise TensorShapeError(path, f"{where}: capacity {capacity} rows is >= 2**31")
            inner = MLX_BUN_DTYPES[slot["dtype"]].itemsize * shape[3]
            run, gap = shape[2] * inner, (capacity - shape[2]) * inner
            shape[2] = capacity
        expected = None
        if verify_hash:
            h = slot.get("hash")
            if not isinstance(h, str) or not _HEX16.fullmatch(h):
                raise HeaderFieldError(
                    path, f"{where}: hash {_short(h)} is not 16 lowercase hex chars"
                )
            expected = h
        return cls(
            path,
            slot,
            where,
            source,
            shape,
            run,
            gap,
            expected,
            BunHasher() if verify_hash else None,
            inner,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the array as allocated."""
        rows = self.source.stored_len // self.run if self.run else 0
        return self.source.stored_len + rows * self.gap

    def fill(self, dst: memoryview, voff: int) -> None:
        """Fill ``dst`` with the allocated array's bytes from ``voff``."""
        period = self.run + self.gap
        while dst.nbytes:
            row, within = divmod(voff, period) if self.gap else (0, voff)
            if within < self.run:
                k = min(dst.nbytes, self.run - within)
                at = row * self.run + within
                piece = dst[:k]
                self.source.readinto(piece, at)
                if self.hasher is not None:
                    if at == self.next_stored:
                        self.hasher.update(piece)
                        self.next_stored += k
                    else:
                        self.in_order = False
            else:
                k = min(dst.nbytes, period - within, len(_ZEROS))
                dst[:k] = _ZEROS[:k]
            dst, voff = dst[k:], voff + k

    def check_hash(self) -> None:
        """Compare the stored bytes' Bun.hash with the header's (``verify=True``)."""
        if self.hasher is None or self.hash_expected is None:
            return
        if not (self.in_order and self.next_stored == self.source.stored_len):
            self.hasher = BunHasher()  # reads came out of order: hash again
            buf = memoryview(bytearray(min(_BOUNCE, self.source.stored_len)))
            for at in range(0, self.source.stored_len, _BOUNCE):
                piece = buf[: min(_BOUNCE, self.source.stored_len - at)]
                self.source.readinto(piece, at)
                self.hasher.update(piece)
        got = self.hasher.hexdigest()
        if got != self.hash_expected:
            raise FileDigestMismatchError(
                self.path,
                f"{self.where}: tensor hash mismatch at offset {self.slot['off']}: header "
                f"{self.hash_expected}, bytes hash to {got}",
                self.hash_expected,
                got,
            )


class _PlanStream(TensorStream):
    """The planned tensors of a v3/v5 file as one synthetic safetensors stream."""

    def __init__(self, plans: Sequence[TensorPlan], errors: list[BaseException]) -> None:
        super().__init__([(MLX_BUN_DTYPES[p.slot["dtype"]].name, p.shape) for p in plans], errors)
        self._plans = plans

    def fill(self, index: int, offset: int, out: memoryview) -> None:
        self._plans[index].fill(out, offset)


def load_arrays(path: str, fd: int, plans: Sequence[TensorPlan], verify: bool) -> list[mx.array]:
    """Every planned tensor as an evaluated MLX array, filled in one copy."""
    for p in plans:
        if isinstance(p.source, FileRange):
            p.source.fd = fd
    try:
        if not plans:
            return []
        try:
            arrays = load_tensors(lambda errors: _PlanStream(plans, errors), len(plans))
        except FileFormatError:
            raise
        except (RuntimeError, ValueError) as e:
            raise FileFormatError(path, f"cannot load tensors: {e}") from e
        for p in plans:
            p.check_hash()
            p.source.verify(verify)
        return arrays
    finally:
        for p in plans:
            p.source.close()


def tensor_pieces(t: TensorData) -> list[memoryview]:
    """The bytes stored for ``t``: memoryviews of its evaluated array's live rows."""
    arr = t.array
    mx.eval(arr)
    if arr.nbytes == 0:
        return []
    mv = memoryview(arr)  # type: ignore[arg-type]  # mlx arrays export the buffer protocol
    if not mv.c_contiguous:
        arr = mx.contiguous(arr)
        mx.eval(arr)
        mv = memoryview(arr)  # type: ignore[arg-type]
    flat = mv.cast("B")
    shape = list(arr.shape)
    if t.length is None or t.length == shape[t.axis]:
        return [flat]
    outer = 1
    for d in shape[: t.axis]:
        outer *= d
    inner = arr.itemsize
    for d in shape[t.axis + 1 :]:
        inner *= d
    stride, run = shape[t.axis] * inner, t.length * inner
    return [flat[o * stride : o * stride + run] for o in range(outer)]
