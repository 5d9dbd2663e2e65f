"""From blocks to arrays: restore tensors with one copy from the page cache.

``mx.load`` accepts a file-like object and fills its own freshly allocated
arrays through ``readinto``. :class:`BlockStream` serves a small safetensors
header and then each tensor's bytes, gathered from the block files with
``os.preadv`` straight into the array's memory. Token-axis tensors may be
allocated with spare rows (a KVCache's step capacity); those are zeroed.
"""

from __future__ import annotations

import bisect
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from .layout import block_rows, geometry, spec_nbytes
from .schema import TensorSpec

_ST_DTYPE = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
}
_ZEROS = bytes(1 << 20)


@dataclass(frozen=True)
class Run:
    """``length`` bytes at ``dst`` of the stream: from ``fd`` at ``src``, or zeros (fd -1)."""

    dst: int
    length: int
    fd: int
    src: int


@dataclass(frozen=True)
class Want:
    """One tensor to restore: its spec and the rows to allocate on its token axis."""

    spec: TensorSpec
    capacity: int | None = None  # token tensors only


def plan_runs(
    wants: Sequence[Want],
    *,
    n_tokens: int,
    length: int,
    block_tokens: int,
    token_fds: Sequence[int],
    state_fds: Sequence[int],
    state_block: int,
) -> tuple[list[tuple[str, list[int]]], list[list[Run]]]:
    """For each tensor: (dtype, shape as restored) and the runs that fill it.

    ``n_tokens`` is the entry's length (it fixes the block layout); ``length``
    the prefix restored (it fixes which rows are read).
    """
    specs = [w.spec for w in wants]
    token_specs = [s for s in specs if s.token_axis is not None]
    geoms = {id(s): geometry(s.shape, s.dtype, s.token_axis) for s in token_specs}
    # byte offset of each token tensor inside block b: sum of earlier tensors' share
    n_blocks = len(token_fds)
    before: dict[int, list[int]] = {}
    acc = [0] * n_blocks
    for s in token_specs:
        g = geoms[id(s)]
        before[id(s)] = list(acc)
        for b in range(n_blocks):
            acc[b] += g.outer * block_rows(b, n_tokens, block_tokens) * g.row_bytes
    shapes: list[tuple[str, list[int]]] = []
    plans: list[list[Run]] = []
    for w in wants:
        s = w.spec
        runs: list[Run] = []
        if s.token_axis is not None:
            g = geoms[id(s)]
            cap = w.capacity if w.capacity is not None else length
            shape = list(s.shape)
            shape[s.token_axis] = cap
            for o in range(g.outer):
                base = o * cap * g.row_bytes
                for b in range(n_blocks):
                    r0 = b * block_tokens
                    take = min(length - r0, block_tokens)
                    if take <= 0:
                        break
                    rows_b = block_rows(b, n_tokens, block_tokens)
                    src = before[id(s)][b] + o * rows_b * g.row_bytes
                    runs.append(Run(base + r0 * g.row_bytes, take * g.row_bytes, token_fds[b], src))
                if cap > length:
                    runs.append(
                        Run(base + length * g.row_bytes, (cap - length) * g.row_bytes, -1, 0)
                    )
        else:
            shape = list(s.shape)
            assert s.state_offset is not None
            pos, end = s.state_offset, s.state_offset + spec_nbytes(s)
            while pos < end:
                blk, off = divmod(pos, state_block)
                take = min(end - pos, state_block - off)
                runs.append(Run(pos - s.state_offset, take, state_fds[blk], off))
                pos += take
        shapes.append((s.dtype, shape))
        plans.append(runs)
    return shapes, plans


class BlockStream(io.RawIOBase):
    """A read-only safetensors file assembled on the fly from block files."""

    def __init__(self, shapes: Sequence[tuple[str, list[int]]], plans: Sequence[list[Run]]):
        super().__init__()
        header: dict[str, object] = {}
        offset = 0
        self._starts: list[int] = []
        self._runs: list[list[Run]] = list(plans)
        for i, (dtype, shape) in enumerate(shapes):
            n = 1
            for d in shape:
                n *= d
            from .layout import itemsize

            nbytes = n * itemsize(dtype)
            header[f"{i:06d}"] = {
                "dtype": _ST_DTYPE[dtype],
                "shape": shape,
                "data_offsets": [offset, offset + nbytes],
            }
            self._starts.append(offset)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._head = len(raw).to_bytes(8, "little") + raw
        self._size = len(self._head) + offset
        self._pos = 0
        self._run_dsts = [[r.dst for r in runs] for runs in self._runs]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            self._pos = offset
        elif whence == 1:
            self._pos += offset
        else:
            self._pos = self._size + offset
        return self._pos

    def readinto(self, buf: object) -> int:
        mv = memoryview(buf).cast("B")  # type: ignore[arg-type]
        want = min(len(mv), self._size - self._pos)
        if want <= 0:
            return 0
        done = 0
        head = len(self._head)
        if self._pos < head:
            n = min(want, head - self._pos)
            mv[:n] = self._head[self._pos : self._pos + n]
            done = n
        while done < want:
            data_pos = self._pos + done - head
            t = bisect.bisect_right(self._starts, data_pos) - 1
            t_end = self._starts[t + 1] if t + 1 < len(self._starts) else self._size - head
            stop = min(t_end, data_pos + (want - done))
            self._fill(t, data_pos - self._starts[t], stop - self._starts[t], mv[done:])
            done += stop - data_pos
        self._pos += done
        return done

    def _fill(self, t: int, a: int, b: int, out: memoryview) -> None:
        """Bytes ``[a, b)`` of tensor ``t`` into ``out[0 : b-a]``."""
        runs = self._runs[t]
        i = max(bisect.bisect_right(self._run_dsts[t], a) - 1, 0)
        while i < len(runs) and runs[i].dst < b:
            r = runs[i]
            lo, hi = max(a, r.dst), min(b, r.dst + r.length)
            if lo < hi:
                dst = out[lo - a : hi - a]
                if r.fd < 0:
                    for z in range(0, hi - lo, len(_ZEROS)):
                        piece = dst[z : z + len(_ZEROS)]
                        piece[:] = _ZEROS[: len(piece)]
                else:
                    src = r.src + (lo - r.dst)
                    got = os.preadv(r.fd, [dst], src)
                    if got != hi - lo:
                        from .errors import CorruptBlockError

                        raise CorruptBlockError(f"fd {r.fd}", f"{hi - lo} bytes", f"{got}")
            i += 1


def load_arrays(
    shapes: Sequence[tuple[str, list[int]]], plans: Sequence[list[Run]]
) -> list[mx.array]:
    """Restore the tensors in one ``mx.load`` of a :class:`BlockStream`."""
    if not shapes:
        return []
    loaded = mx.load(BlockStream(shapes, plans), format="safetensors")  # type: ignore[arg-type]
    assert isinstance(loaded, dict)
    return [loaded[f"{i:06d}"] for i in range(len(shapes))]
