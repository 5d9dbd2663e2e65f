"""Limit rows: each kvstore figure against what the machine itself allows, on the same bytes.

The rows beside mlx-lm say whether kvstore beats the peer; these say how far it
is from the machine's own limit, measured in the same run, on the same block
files or the same cache, with the same threads:

- restore vs ``preadv`` of its block files straight into preallocated,
  evaluated MLX arrays (and, for a verified restore, plus BLAKE3 of them);
- a durable save vs writing its blocks to as many new files plus one round of
  fsyncs (and the directory's);
- a non-durable save vs max(hashing alone, writing alone), the bound if the two
  halves overlapped perfectly, and vs their sum, the bound when each half
  already keeps every core busy;

Each row's ratio is limit / kvstore: 1.0 is the limit itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

from .._vio import pwritev_all
from ..blocks import new_hasher
from ..blocks.hashing import chain_hashes
from ..blocks.pools import READ_WORKERS, balanced, io_pool
from .common import Row, block_files, fsync_path, median

if TYPE_CHECKING:
    import numpy as np

    from ..store import Store

TARGET = 0.8  # issue 16: kvstore within 0.8x of the machine's limit


def limit_row(name: str, kv: float, limit: float, label: str, *,
              target: float | None = TARGET, extra: dict[str, float] | None = None,
              part_of: str = "") -> Row:
    """A row of group ``limit``: kvstore's seconds against the limit's; ratio = limit / kvstore."""
    ext = dict(extra or {})
    if target is not None:
        ext["target"] = target
    return Row("limit", name, "s", kv, limit, label, "speedup", extra=ext, part_of=part_of)


_CHUNK = 1 << 20  # a limit read hashes what it read while it is in the core's cache


def _clock() -> float:
    return time.perf_counter()


class RawRead:
    """The restore's limit: ``preadv`` of every block file into arrays, on ``threads`` threads.

    The files are opened and read inside the timed call, spread over the threads (the
    caller's among them), each file into its own uint8 array: arrays allocated once and
    reused (the default), or, with ``fresh``, new ones each call (NumPy's). ``hash`` adds
    BLAKE3 of each file, a chunk at a time as it is read, on the thread that read it, as a
    verified restore must.

    A fresh array is freed as soon as its file is hashed, unless ``hold``. Freed, it is not
    fresh memory for the next file: after the first free of a block-sized array glibc
    raises its mmap threshold and serves every later one from its heap, at the same
    address, so each thread reads every file into the same block of memory, faulted in
    once and warm in the caches (two threads of 16 MiB blocks: 32 MiB, this machine's
    whole L3). ``hold`` keeps every array until the call ends, as a restore must deliver
    all of its arrays at once.
    """

    def __init__(self, root: Path, *, threads: int = READ_WORKERS, fresh: bool = False,
                 hold: bool = False) -> None:
        self.paths = [str(p) for p in block_files(root)]
        self.sizes = [os.stat(p).st_size for p in self.paths]
        self.fresh = fresh
        self.hold = hold
        self.arrays = [] if fresh else [mx.zeros((s,), dtype=mx.uint8) for s in self.sizes]
        mx.eval(self.arrays)
        self.views = [memoryview(a).cast("B") for a in self.arrays]  # type: ignore[arg-type]
        self.threads = threads

    def _job(self, idx: list[int], hash: bool) -> list[memoryview]:
        import numpy as np

        held = []
        for i in idx:
            view = (memoryview(np.empty(self.sizes[i], np.uint8))  # type: ignore[arg-type]
                    if self.fresh else self.views[i])
            if self.hold:
                held.append(view)
            h = new_hasher("blake3") if hash else None
            fd = os.open(self.paths[i], os.O_RDONLY)
            try:
                for pos in range(0, self.sizes[i], _CHUNK):
                    piece = view[pos : pos + _CHUNK]
                    got = os.preadv(fd, [piece], pos)
                    if got != len(piece):
                        raise OSError(f"{self.paths[i]}: read {got} of {len(piece)} bytes")
                    if h is not None:
                        h.update(piece)
            finally:
                os.close(fd)
            if h is not None:
                h.digest()
        return held

    def __call__(self, *, hash: bool = False) -> float:
        groups = balanced(self.sizes, self.threads)
        t = _clock()
        futures = [io_pool().submit(self._job, g, hash) for g in groups[1:]]
        held = [self._job(groups[0], hash)]
        held += [f.result() for f in futures]
        dt = _clock() - t
        del held  # freed outside the timing, as a restore's arrays are by its caller
        return dt


def raw_durable_write(scratch: Path, blocks: Sequence[Sequence[memoryview]],
                      parallel: int) -> float:
    """The durable save's limit: its blocks written to as many new files, then one fsync round.

    The writes run ``parallel`` at a time (as a save's do), the fsyncs all at
    once over the I/O threads, then the directory's fsync so the names survive.
    """
    d = Path(tempfile.mkdtemp(prefix="raw-durable-", dir=scratch))
    names = [f"{d}/{i}" for i in range(len(blocks))]

    def write(idx: list[int]) -> None:
        for i in idx:
            fd = os.open(names[i], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                pwritev_all(fd, list(blocks[i]), 0)
            finally:
                os.close(fd)

    sizes = [sum(len(p) for p in b) for b in blocks]
    try:
        t = _clock()
        groups = balanced(sizes, parallel)
        futures = [io_pool().submit(write, g) for g in groups[1:]]
        write(groups[0])
        for f in futures:
            f.result()
        list(io_pool().map(fsync_path, names))
        fsync_path(d)
        return _clock() - t
    finally:
        shutil.rmtree(d, ignore_errors=True)


def restore_limit_rows(names: dict[str, str], shares: dict[str, list[float]],
                       res: dict[str, list[float]], threads: int, *,
                       verified: bool) -> list[Row]:
    """The limit rows of the restore rows ``names`` (``kv``: verified, ``kv_raw``: not), from
    the same runs: ``shares`` holds each run's ``Store.restore`` seconds, ``res`` the raw
    reads timed in the same rounds (``raw``, and ``raw_v`` with BLAKE3). Each row names the
    restore row it is a part of, so one case is measured once."""
    th = f"{threads} threads"
    pairs = [("kv_raw", "raw", f"preadv of its block files into preallocated arrays, {th}")]
    if verified:
        pairs.append(("kv", "raw_v", f"the same preadv + BLAKE3 of every block, {th}"))
    rows = []
    for side, limit, label in pairs:
        row = names[side]
        rows.append(limit_row(
            f"limit: {row}: Store.restore alone", median(shares[side]), median(res[limit]),
            label, extra={"decode_s": median(res[side]) - median(shares[side])}, part_of=row))
    return rows


def lookup_limit_rows(store: Store, queries: Sequence[np.ndarray], label: str) -> list[Row]:
    """A lookup vs the same number of raw ``get``s in one read transaction, query by query.

    Each query's reads are traced first (untimed); then, for each query in turn,
    kvstore's lookup, the replay of its reads as plain gets, and the chain of
    hashes that are its keys, so the three sides share the machine's noise.
    """
    traces = [store.lookup_reads(q) for q in queries]
    algo, width = store.local.settings.hash, 4 * store.block_tokens
    seed = bytes(32)  # any c_0: the chain costs the same
    kv: list[float] = []
    raw: list[float] = []
    keys: list[float] = []
    for q, reads in zip(queries, traces, strict=True):
        store.lookup(q)  # warm this query's pages
        t = _clock()
        store.lookup(q)
        kv.append(_clock() - t)
        t = _clock()
        store.replay_reads(reads)
        raw.append(_clock() - t)
        data = memoryview(q.astype("<u4").tobytes())
        t = _clock()
        chain_hashes(algo, seed, data, width, len(data) // width)
        keys.append(_clock() - t)
    gets = sorted(len(r) for r in traces)[len(traces) // 2]
    extra = {"gets": float(gets)}
    return [
        limit_row(f"limit: lookup {label}", median(kv), median(raw),
                  f"the same {gets} gets (median) in one read transaction", extra=extra),
        limit_row(f"limit: lookup {label}, with its keys", median(kv),
                  median(raw) + median(keys),
                  f"the same gets + the BLAKE3 chain over the query's blocks ({algo})",
                  target=None, extra=extra),
    ]
