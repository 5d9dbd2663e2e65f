"""What the machine allows for a restore onto a CUDA GPU, on the same block files, no MLX.

Each a median, with the restore's read threads, through the CUDA runtime MLX loaded:

- ``read``: every block file read into one pinned host buffer (page cache);
- ``read + BLAKE3``: the same, each block hashed as the staged restore hashes it (a chunk
  at a time, by the thread that read it);
- ``host to device, pinned`` / ``pageable``: one copy of all those bytes to device memory
  from the pinned buffer, and from ordinary memory;
- ``pipeline``: read + BLAKE3 into a ring of pinned slots, each block copied to the card
  as soon as it is read (the staged restore's own loop, ``local.staged.run_jobs``, into
  plain device memory and one copy a block): what a restore could do at best;
- ``cold read`` / ``cold pipeline``: the read and the pipeline after
  ``POSIX_FADV_DONTNEED`` on every file (the disk's own speed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from ..blocks import BlockCheck
from ..blocks.pools import READ_WORKERS, balanced, read_pool
from ..codecs.cudart import Runtime
from ..codecs.staging import Copy, CudaCopier
from ..local.staged import CHUNK, Job, run_jobs
from .common import drop_from_page_cache


class GpuLimits:
    """The rows of the module docstring for the block files ``paths`` (named by digest)."""

    def __init__(self, rt: Runtime, device: int, paths: Sequence[Path], algo: str = "blake3",
                 threads: int = READ_WORKERS) -> None:
        self.rt, self.device, self.threads, self.algo = rt, device, threads, algo
        self.paths = [str(p) for p in paths]
        self.sizes = [os.stat(p).st_size for p in self.paths]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.total = sum(self.sizes)
        self.digests = [bytes.fromhex(os.path.basename(p)) for p in self.paths]
        self.pinned = rt.host_alloc(self.total)
        self.pageable = bytearray(self.total)  # touched: its pages exist
        self.pageable[:: 4096] = b"\1" * len(range(0, self.total, 4096))
        self.dev = rt.malloc(self.total)
        self.stream = rt.stream()
        import ctypes

        self._pin_view = memoryview((ctypes.c_char * self.total).from_address(
            self.pinned)).cast("B")
        self._page_addr = ctypes.addressof(ctypes.c_char.from_buffer(self.pageable))

    def _sync(self) -> None:
        self.rt.sync_stream(self.stream)

    def read(self, *, hash: bool = False) -> float:
        check = BlockCheck(self.algo, list(zip(self.digests, self.sizes, strict=True)),
                           hashing=hash)

        def job(idx: list[int]) -> None:
            for i in idx:
                fd = os.open(self.paths[i], os.O_RDONLY)
                try:
                    base = self.offsets[i]
                    for pos in range(0, self.sizes[i], CHUNK):
                        piece = self._pin_view[base + pos : base + min(self.sizes[i],
                                                                       pos + CHUNK)]
                        got = os.preadv(fd, [piece], pos)
                        if got != len(piece):
                            raise OSError(f"{self.paths[i]}: short read")
                        check.feed(i, pos, [piece])
                finally:
                    os.close(fd)

        groups = balanced(self.sizes, self.threads)
        t = time.perf_counter()
        futures = [read_pool().submit(job, g) for g in groups[1:]]
        job(groups[0])
        for f in futures:
            f.result()
        dt = time.perf_counter() - t
        if hash and check.bad():
            raise AssertionError(f"the limit's blocks hash wrong: {check.bad()}")
        return dt

    def h2d(self, *, pinned: bool = True) -> float:
        src = self.pinned if pinned else self._page_addr
        self._sync()
        t = time.perf_counter()
        self.rt.copy(self.dev, src, self.total, self.stream)
        self._sync()
        return time.perf_counter() - t

    def pipeline(self) -> float:
        jobs = [Job(i, s, [Copy(self.dev + o, 0, s)])
                for i, (s, o) in enumerate(zip(self.sizes, self.offsets, strict=True))]
        check = BlockCheck(self.algo, list(zip(self.digests, self.sizes, strict=True)))
        t = time.perf_counter()
        fds = {i: os.open(p, os.O_RDONLY) for i, p in enumerate(self.paths)}
        copier = CudaCopier(self.rt, self.device)
        try:
            ring = copier.ring(min(len(jobs), self.threads + 2), max(self.sizes))
            run_jobs(jobs, fds, check, copier, ring, self.threads)
        finally:
            copier.finish()
            for fd in fds.values():
                os.close(fd)
        dt = time.perf_counter() - t
        if check.bad():
            raise AssertionError(f"the pipeline's blocks hash wrong: {check.bad()}")
        return dt

    def drop(self) -> None:
        drop_from_page_cache([Path(p) for p in self.paths])

    def close(self) -> None:
        self.rt.free(self.dev)
        self.rt.free_host(self.pinned)
        self.rt.destroy_stream(self.stream)
