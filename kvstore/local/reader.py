"""From blocks to arrays: restore tensors with one copy from the page cache.

``mx.load`` accepts a file-like object and fills its own freshly allocated
arrays through ``readinto``. :class:`BlockStream` serves a small safetensors
header and then each tensor's bytes, gathered from the block files with
``os.preadv`` straight into the array's memory. Token-axis tensors may be
allocated with spare rows (a KVCache's step capacity); those are zeroed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from .._vio import ShortReadError, cached, preadv_all
from ..blocks import BlockCheck
from ..blocks.pools import READ_WORKERS, balanced, read_pool
from ..codecs.layout import (
    block_rows,
    geometry,
    in_token_blocks,
    in_window_blocks,
    itemsize,
    spec_nbytes,
    window_first_block,
    window_rows,
)
from ..codecs.mxload import TensorStream, load_tensors
from ..codecs.warm import restoring
from ..schema import TensorSpec

_ZEROS = bytes(1 << 20)
_IOV_MAX = 1024
_PARALLEL_BYTES = 1 << 20  # smaller tensors are read on the caller's thread
#: The most block slots whose files a read holds open at once. Importing mlx-lm sets the
#: soft RLIMIT_NOFILE to 2048; an entry of more blocks is read a window at a time.
FD_WINDOW = 256


@dataclass(slots=True)
class Run:
    """``count`` pieces of ``length`` bytes of the stream, the i-th at ``dst + i*stride``.

    Piece i comes from the file of block ``slot`` at ``src + i*src_stride``, or is
    zeros (slot -1). ``slot`` is the block's place in the read (its
    :class:`BlockCheck` slot; its file is opened only when the read gets to it).
    A run is one tensor's share of one block: its ``outer`` runs of rows sit
    back to back in the block file, so a whole-block run is one ``preadv``.
    ``skip`` is how many bytes after each piece the file holds that the
    restore does not need (the rows of a partly restored last block); a
    verified read reads them too, into scratch memory, to hash the whole block.

    Never changed once planned. Not frozen: a restore of 16 layers and 16 blocks plans
    512 runs on its caller's thread before any read starts, and a frozen dataclass takes
    3.5x as long to make (0.93 against 0.27 ms for 512).
    """

    dst: int
    length: int
    slot: int
    src: int
    count: int = 1
    stride: int = 0
    src_stride: int = 0
    skip: int = 0

    @property
    def end(self) -> int:
        """One past the last byte of the stream the run fills."""
        return self.dst + (self.count - 1) * self.stride + self.length


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
    token_blocks: int,
    state_blocks: int,
    state_block: int,
    window_blocks: int = 0,
) -> tuple[list[tuple[str, list[int]]], list[list[Run]]]:
    """For each tensor: (dtype, shape as restored) and the runs that fill it.

    ``n_tokens`` is the entry's length (it fixes the block layout); ``length``
    the prefix restored (it fixes which token-block rows are read; window
    tensors are read whole). The read uses ``token_blocks`` token blocks,
    ``window_blocks`` window blocks and ``state_blocks`` state blocks: token block
    ``b`` is slot ``b``, window block ``i`` slot ``token_blocks + i``, state block
    ``j`` slot after those.
    """
    specs = [w.spec for w in wants]
    window = _window_runs(specs, n_tokens, block_tokens, window_blocks, token_blocks)
    n_slots = token_blocks + window_blocks
    token_specs = [s for s in specs if in_token_blocks(s)]
    geoms = {id(s): geometry(s.shape, s.dtype, s.token_axis) for s in token_specs}
    # byte offset of each token tensor inside block b: sum of earlier tensors' share
    n_blocks = token_blocks
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
        if in_window_blocks(s):
            shapes.append((s.dtype, list(s.shape)))
            plans.append(window[id(s)])
            continue
        if s.token_axis is not None:
            g = geoms[id(s)]
            cap = w.capacity if w.capacity is not None else length
            shape = list(s.shape)
            shape[s.token_axis] = cap
            stride = cap * g.row_bytes
            for b in range(n_blocks):
                r0 = b * block_tokens
                take = min(length - r0, block_tokens)
                if take <= 0:
                    break
                rows_b = block_rows(b, n_tokens, block_tokens)
                runs.append(Run(r0 * g.row_bytes, take * g.row_bytes, b,
                                before[id(s)][b], g.outer, stride, rows_b * g.row_bytes,
                                skip=(rows_b - take) * g.row_bytes))
            if cap > length:
                runs.append(Run(length * g.row_bytes, (cap - length) * g.row_bytes, -1, 0,
                                g.outer, stride))
        else:
            shape = list(s.shape)
            assert s.state_offset is not None
            pos, end = s.state_offset, s.state_offset + spec_nbytes(s)
            while pos < end:
                blk, off = divmod(pos, state_block)
                if blk >= state_blocks:
                    raise IndexError(f"state block {blk} of {state_blocks}")
                take = min(end - pos, state_block - off)
                runs.append(Run(pos - s.state_offset, take, n_slots + blk, off))
                pos += take
        shapes.append((s.dtype, shape))
        plans.append(runs)
    return shapes, plans


def _window_runs(
    specs: Sequence[TensorSpec], n_tokens: int, T: int, n_blocks: int, slot0: int
) -> dict[int, list[Run]]:
    """The runs that fill each window tensor (by ``id`` of its spec) from the ``n_blocks``
    window blocks, the first of them slot ``slot0``."""
    window = [s for s in specs if in_window_blocks(s)]
    first = window_first_block(window, T)
    out: dict[int, list[Run]] = {id(s): [] for s in window}
    for i in range(n_blocks):
        b = first + i
        pos = 0  # where the next tensor's rows start inside this block
        for s in window:
            assert s.window_start is not None and s.token_axis is not None
            g = geometry(s.shape, s.dtype, s.token_axis)
            a, z = window_rows(s.window_start, b, n_tokens, T)
            if z <= a:
                continue
            piece = (z - a) * g.row_bytes
            out[id(s)].append(Run(a * g.row_bytes, piece, slot0 + i, pos, g.outer,
                                  g.rows * g.row_bytes, piece))
            pos += g.outer * piece
    return out


class BlockFiles(Protocol):
    """The block files of one read, opened a window of slots at a time."""

    def window(self, lo: int, hi: int) -> AbstractContextManager[Mapping[int, int]]:
        """A descriptor per slot in ``[lo, hi)``, open for the ``with`` block only; a
        slot left out could not be opened (its reads are skipped, its block failed).
        Never raises: the caller asks the files what went wrong after the load."""
        ...


class BlockStream(TensorStream):
    """A read-only safetensors file assembled on the fly from block files.

    MLX asks for the tensors one at a time, each from its own thread and under
    the GIL. ``fill`` only notes where each tensor's bytes go (the memory MLX
    allocated for it); ``finish``, called once every array exists, reads all of
    them in one round over the read threads, so no thread waits at the end of
    each tensor for the others (on 16 cores that barrier cost more than the
    copies). Every byte read from a block is passed to ``check`` (which hashes
    it when the read is verified) by the thread that read it. The reads go in
    windows of ``FD_WINDOW`` slots, each window's files open only while it is
    read (``files``), so an entry of any size holds a bounded number of
    descriptors; an entry of one window reads in one round, as before.
    """

    def __init__(
        self,
        shapes: Sequence[tuple[str, list[int]]],
        plans: Sequence[list[Run]],
        errors: list[BaseException],
        check: BlockCheck,
        files: BlockFiles,
    ) -> None:
        super().__init__(shapes, errors)
        self._runs: list[list[Run]] = list(plans)
        self._check = check
        self._files = files
        self._reads: list[_Read] = []
        self._zeros: list[memoryview] = []

    def fill(self, index: int, offset: int, out: memoryview) -> None:
        self._plan(index, offset, offset + len(out), out)

    def finish(self) -> None:
        reads, zeros = self._reads, self._zeros
        self._reads, self._zeros = [], []
        windows: dict[int, list[_Read]] = {}
        for r in reads:
            windows.setdefault(r.slot // FD_WINDOW, []).append(r)
        if not windows:
            _run_reads([], zeros)
        for w in sorted(windows):
            group = windows[w]
            with self._files.window(w * FD_WINDOW, (w + 1) * FD_WINDOW) as fds:
                ready = []
                for r in group:
                    if r.slot in fds:
                        r.fd = fds[r.slot]
                        ready.append(r)
                    else:
                        self._check.fail(r.slot, "its file could not be opened")
                _run_reads(ready, zeros)  # the spare rows are zeroed beside the first window
            zeros = []

    def _plan(self, t: int, a: int, b: int, out: memoryview) -> None:
        """The reads of bytes ``[a, b)`` of tensor ``t`` into ``out[0 : b-a]``.

        They are gathered into one ``preadv`` per (run, block) — many iovecs,
        each straight into the array's memory. A verified read of a partly
        restored block reads the rows it does not need into scratch memory, in
        the same ``preadv``, so that the whole block is hashed.
        """
        check = self._check
        whole = check.hashing
        reads, zeros = self._reads, self._zeros
        for r in self._runs[t]:
            if r.end <= a or r.dst >= b or r.length == 0:
                continue
            if a <= r.dst and r.end <= b:  # the common case: the whole run
                if r.slot >= 0 and (r.src_stride == r.length or r.count == 1
                                    or (whole and r.skip)):
                    # one preadv; its views are made by the thread that reads it
                    reads.append(_RowsRead(r.src, r.slot, check, out, r.dst - a, r.length,
                                           r.count, r.stride, r.skip if whole else 0))
                    continue
                starts = (range(r.dst, r.dst + r.count * r.stride, r.stride)
                          if r.count > 1 else (r.dst,))
                views = [out[d - a : d - a + r.length] for d in starts]
                if r.slot < 0:
                    zeros.extend(views)
                else:
                    reads.extend(_Read(r.src + i * r.src_stride, [v], r.slot, check)
                                 for i, v in enumerate(views))
                continue
            for i in range(r.count):
                d0 = r.dst + i * r.stride
                lo, hi = max(a, d0), min(b, d0 + r.length)
                if lo >= hi:
                    continue
                view = out[lo - a : hi - a]
                if r.slot < 0:
                    zeros.append(view)
                    continue
                iov = [view]
                if whole and r.skip and hi == d0 + r.length:
                    iov.append(memoryview(bytearray(r.skip)))
                reads.append(_Read(r.src + i * r.src_stride + (lo - d0), iov, r.slot, check))


@dataclass(slots=True)
class _Read:
    """One ``preadv``: consecutive bytes of block ``slot`` from ``offset`` into ``views``
    (``fd``: the block's file, set once its window is open). ``nbytes`` is summed once:
    a restore's planning asks for it several times a read, thousands of reads a restore."""

    offset: int
    views: list[memoryview]
    slot: int
    check: BlockCheck = field(repr=False)
    fd: int = -1
    nbytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(len(v) for v in self.views)

    def iovecs(self) -> list[memoryview]:
        """The buffers to read into, in file order."""
        return self.views

    def run(self) -> None:
        """Read, then hand the bytes to the check while they are in this core's cache.

        A short read (a regular file reads short only at its end: truncated
        under us) or a read error marks the block bad instead of raising, so
        the restore finishes and the caller decides what a bad block means.
        """
        pos = self.offset
        views = self.iovecs()
        for i in range(0, len(views), _IOV_MAX):
            batch = views[i : i + _IOV_MAX]
            try:
                preadv_all(self.fd, batch, pos)
            except ShortReadError as e:
                self.check.fail(self.slot, f"{e.got} of {e.want} bytes at offset {pos}")
                return
            except OSError as e:
                self.check.fail(self.slot, f"a read error ({e.strerror})")
                return
            self.check.feed(self.slot, pos, batch)
            pos += self.nbytes if len(batch) == len(views) else sum(len(v) for v in batch)


class _RowsRead(_Read):
    """The read of a whole run: ``count`` pieces of ``length`` bytes, the i-th at
    ``first + i*stride`` of ``out``, back to back in the block file from ``offset``, each
    followed there by ``skip`` bytes read into scratch memory (a verified read of a partly
    restored block). Its views are made when it runs, on the read thread: a restore of 16
    layers and 16 blocks has 4,096 of them, which made on the thread that plans the reads
    (under the GIL, before any read starts) cost about 2 ms of every restore."""

    __slots__ = ("_rows",)

    def __init__(self, offset: int, slot: int, check: BlockCheck, out: memoryview, first: int,
                 length: int, count: int, stride: int, skip: int) -> None:
        self.offset, self.slot, self.check, self.fd = offset, slot, check, -1
        self.views = []
        self.nbytes = count * (length + skip)
        self._rows = (out, first, length, count, stride, skip)

    def iovecs(self) -> list[memoryview]:
        out, first, length, count, stride, skip = self._rows
        views = ([out[d : d + length] for d in range(first, first + count * stride, stride)]
                 if count > 1 else [out[first : first + length]])
        if not skip:
            return views
        scratch = memoryview(bytearray(skip * count))
        iov: list[memoryview] = []
        for i, v in enumerate(views):
            iov += (v, scratch[i * skip : (i + 1) * skip])
        return iov


def _zero(views: list[memoryview]) -> None:
    for z in views:
        for off in range(0, len(z), len(_ZEROS)):
            piece = z[off : off + len(_ZEROS)]
            piece[:] = _ZEROS[: len(piece)]


def _run_group(group: list[_Read], zeros: list[memoryview] | None = None) -> None:
    if zeros:
        _zero(zeros)
    for job in group:
        job.run()


def _by_block(reads: list[_Read]) -> list[list[_Read]]:
    """The reads of each block, in file order: a thread that takes a block whole hashes each
    piece as soon as it has read it, while it is in its core's cache (pieces of one block
    spread over threads arrive out of order, wait, and are hashed later from memory)."""
    blocks: dict[int, list[_Read]] = {}
    for r in reads:
        blocks.setdefault(r.slot, []).append(r)
    return [sorted(b, key=lambda r: r.offset) for b in blocks.values()]


#: Threads for a read whose blocks are in the page cache: each copies and hashes, which
#: keeps a core busy, so one a core (more only take turns on the cores, and cost more: on 2
#: cores the 256 MiB restore took 54.5 ms on 2 threads against 63.4 on 6, and 89 against 100
#: ms of CPU, tools/probe_restore_limit.py --threads 2,6). A read that waits on the disk
#: keeps READ_WORKERS in flight.
CACHED_THREADS = min(READ_WORKERS, max(2, os.cpu_count() or 2))


def read_threads(blocks: Sequence[Sequence[_Read]]) -> int:
    """How many threads read ``blocks`` (each a block's reads in file order, their files
    open): :data:`CACHED_THREADS` when the first and the last byte each block's reads want
    are in the page cache (:func:`kvstore._vio.cached`: a few microseconds a block), else
    ``READ_WORKERS`` (also where the system cannot tell)."""
    if CACHED_THREADS >= READ_WORKERS:
        return READ_WORKERS
    for b in blocks:
        first, last = b[0], b[-1]
        if first.fd != last.fd or not cached(first.fd, (first.offset,
                                                         last.offset + last.nbytes - 1)):
            return READ_WORKERS
    return CACHED_THREADS


def _run_reads(reads: list[_Read], zeros: list[memoryview]) -> None:
    """Run the reads over the read threads and this one (whole blocks to a thread where there
    are blocks enough; as many threads as :func:`read_threads` says); each thread zeroes its
    share of the spare rows first."""
    total = sum(r.nbytes for r in reads)
    if len(reads) <= 1 or total < _PARALLEL_BYTES:
        _run_group(reads, zeros)
        return
    blocks = _by_block(reads)
    threads = read_threads(blocks)
    if len(blocks) >= threads:
        groups = [[r for i in g for r in blocks[i]] for g in
                  balanced([sum(r.nbytes for r in b) for b in blocks], threads)]
    else:  # too few blocks to keep every thread busy: their pieces spread over them
        groups = [[reads[i] for i in g]
                  for g in balanced([r.nbytes for r in reads], threads)]
    shares: list[list[memoryview]] = [[] for _ in groups]
    for i, z in enumerate(zeros):
        shares[i % len(groups)].append(z)
    pool = read_pool()
    mine, my_zeros = groups[0], shares[0]
    futures = []
    for g, zs in zip(groups[1:], shares[1:], strict=True):
        try:
            futures.append(pool.submit(_run_group, g, zs))
        except RuntimeError:  # the interpreter is shutting down: read on this thread
            mine, my_zeros = mine + g, my_zeros + zs
    try:
        _run_group(mine, my_zeros)
    finally:
        for f in futures:
            f.result()


def load_arrays(
    shapes: Sequence[tuple[str, list[int]]], plans: Sequence[list[Run]], check: BlockCheck,
    files: BlockFiles,
) -> list[mx.array]:
    """Restore the tensors in one ``mx.load`` of a :class:`BlockStream` over ``files``.

    Afterwards ``check.bad()`` says which blocks did not read right (or, when
    it hashes, did not hash to their names): the arrays then hold wrong bytes.
    A block ``files`` could not open is failed in ``check``. A process that restores
    again and again keeps memory warm for its restores (:mod:`kvstore.codecs.warm`).
    """
    nbytes = 0
    for dtype, shape in shapes:
        n = itemsize(dtype)
        for d in shape:
            n *= d
        nbytes += n
    restoring(nbytes)
    return load_tensors(lambda errors: BlockStream(shapes, plans, errors, check, files),
                        len(shapes))
