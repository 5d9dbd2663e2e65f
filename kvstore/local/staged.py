"""A restore through staging buffers: onto a CUDA GPU, at the speed of the link.

The host path (:class:`~kvstore.local.reader.BlockStream`) reads each tensor's share of
a block straight into the array's memory. On a CUDA GPU that memory is managed memory, and
the first kernel that touches a restored cache would pull every page of it across as a
demand fault. :class:`StagedStream` instead only notes where each array lives, moves its
pages to the card, and then, over the read threads:

1. each block is read whole (a verified read hashes it whole anyway) into a free slot of
   a ring of staging buffers (pinned memory on a GPU), in chunks, each chunk handed to
   the block's check while it is in the reading core's cache;
2. the block's runs (one per tensor it holds a share of) are queued as copies out of the
   slot (a 2-D copy each: the tensor's rows are strided in the array, packed in the
   block), and the thread takes the next block;
3. a slot is reused only after the copies out of it are done (its event).

Reads, hashes and copies overlap; the restore returns once every copy is done, so the
arrays are ready on the card when the first decode step runs. A block that reads short or
hashes wrong is failed in the check and its copies are not made (the caller drops the
arrays, as on the host path); a copy that fails stops the reads, waits for what was
queued and raises. The copy step is a :class:`~kvstore.codecs.staging.Copier`, so the
whole pipeline runs on the host too (``HostCopier``), which is how it is tested.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from .._vio import ShortReadError, preadv_all
from ..blocks import BlockCheck
from ..blocks.pools import READ_WORKERS, read_pool
from ..codecs.layout import itemsize
from ..codecs.mxload import TensorStream, load_tensors
from ..codecs.staging import RING_BYTES, Copier, Copy, address_of
from ..codecs.warm import restoring
from ..errors import KVStoreError
from .reader import FD_WINDOW, BlockFiles, Run

#: Bytes read (and hashed) at a time: small enough to hash while in the core's cache.
CHUNK = 4 << 20
#: Slots in the ring beyond one per read thread: a slot whose copies are in flight is
#: not yet free.
SPARE_SLOTS = 2


class StagingError(KVStoreError):
    """MLX did not hand a tensor's memory over as one buffer (the staged read needs each
    array's own address)."""


@dataclass
class Job:
    """One block of a staged read: its check slot, the bytes to read from its start, and
    the copies out of them."""

    slot: int
    nbytes: int
    copies: list[Copy] = field(default_factory=list)


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    n = itemsize(dtype)
    for d in shape:
        n *= d
    return n


def plan_jobs(
    plans: Sequence[Sequence[Run]], bases: Sequence[int], check: BlockCheck, *, tail: int
) -> tuple[list[Job], list[tuple[int, int, int, int]]]:
    """The jobs of a staged read, one per block slot that a run reads (in slot order), and
    the zeroed spans (address, pitch, width, rows): ``plans[t]`` are tensor ``t``'s runs,
    ``bases[t]`` the address of its first byte. A verified read reads every block whole
    (but its ``tail``, the salt the check adds); an unverified one only as far as a run
    needs."""
    jobs: dict[int, Job] = {}
    zeros: list[tuple[int, int, int, int]] = []
    for runs, base in zip(plans, bases, strict=True):
        for r in runs:
            if r.length == 0:
                continue
            pitch = r.stride if r.count > 1 else r.length
            if r.slot < 0:
                zeros.append((base + r.dst, pitch, r.length, r.count))
                continue
            spitch = r.src_stride if r.count > 1 else r.length
            job = jobs.get(r.slot)
            if job is None:
                job = jobs[r.slot] = Job(r.slot, 0)
            job.copies.append(Copy(base + r.dst, r.src, r.length, r.count, pitch, spitch))
            job.nbytes = max(job.nbytes, r.src + (r.count - 1) * spitch + r.length)
    if check.hashing:
        for job in jobs.values():
            job.nbytes = max(job.nbytes, check.size(job.slot) - tail)
    return [jobs[s] for s in sorted(jobs)], zeros


def _read_block(job: Job, fd: int, buf: memoryview, check: BlockCheck) -> bool:
    """Read ``job``'s bytes into ``buf`` a chunk at a time, each handed to the check; False
    (and the block failed) when the file reads short or fails, or a verified block does
    not hash to its name: its bytes are then never copied on."""
    pos = 0
    while pos < job.nbytes:
        piece = buf[pos : min(job.nbytes, pos + CHUNK)]
        try:
            preadv_all(fd, [piece], pos)
        except ShortReadError as e:
            check.fail(job.slot, f"{pos + e.got} of {job.nbytes} bytes read")
            return False
        except OSError as e:
            check.fail(job.slot, f"a read error ({e.strerror})")
            return False
        check.feed(job.slot, pos, [piece])
        pos += len(piece)
    return check.settle(job.slot)


def run_jobs(jobs: Sequence[Job], fds: Mapping[int, int], check: BlockCheck, copier: Copier,
             ring: Sequence[memoryview], threads: int) -> None:
    """Read, check and send every job over ``threads`` threads (this one among them), each
    into a free slot of ``ring``; raises the first error a copy or a thread met, after
    waiting for every copy already queued."""
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    for k in range(len(ring)):
        free.put(k)
    order = iter(range(len(jobs)))
    lock = threading.Lock()
    failed: list[BaseException] = []

    def work() -> None:
        while not failed:
            with lock:
                i = next(order, None)
            if i is None:
                return
            job = jobs[i]
            fd = fds.get(job.slot)
            if fd is None:
                check.fail(job.slot, "its file could not be opened")
                continue
            k = free.get()
            try:
                copier.wait(k)  # the copies out of this slot's last block are done
                if _read_block(job, fd, ring[k][: job.nbytes], check):
                    copier.send(k, job.copies)
            except BaseException as e:  # noqa: BLE001 - raised by the caller, once
                failed.append(e)
                return
            finally:
                free.put(k)

    n = max(1, min(threads, len(jobs), len(ring)))
    futures = []
    pool = read_pool()
    for _ in range(n - 1):
        try:
            futures.append(pool.submit(work))
        except RuntimeError:  # the interpreter is shutting down: this thread does it all
            break
    try:
        work()
    finally:
        for f in futures:
            f.result()
    if failed:
        raise failed[0]


class StagedStream(TensorStream):
    """A safetensors stream for ``mx.load`` whose ``fill`` only notes each array's address;
    ``finish`` runs the staged read of the module docstring into them through ``copier``."""

    def __init__(
        self,
        shapes: Sequence[tuple[str, list[int]]],
        plans: Sequence[list[Run]],
        errors: list[BaseException],
        check: BlockCheck,
        files: BlockFiles,
        copier: Copier,
        *,
        threads: int = READ_WORKERS,
    ) -> None:
        super().__init__(shapes, errors)
        self._shapes = list(shapes)
        self._plans = list(plans)
        self._check = check
        self._files = files
        self._copier = copier
        self._threads = threads
        self._bases: dict[int, int] = {}

    def fill(self, index: int, offset: int, out: memoryview) -> None:
        base = address_of(out) - offset
        if self._bases.setdefault(index, base) != base:
            raise StagingError(f"tensor {index}'s bytes came in two buffers")

    def finish(self) -> None:
        bases = []
        for i, (dtype, shape) in enumerate(self._shapes):
            if i not in self._bases and tensor_nbytes(dtype, shape):
                raise StagingError(f"tensor {i}'s memory was never handed over")
            bases.append(self._bases.get(i, 0))
        jobs, zeros = plan_jobs(self._plans, bases, self._check, tail=len(self._check.tail))
        copier = self._copier
        sizes = [tensor_nbytes(d, s) for d, s in self._shapes]
        try:
            copier.prepare([(b, n) for b, n in zip(bases, sizes, strict=True) if n])
            for dst, pitch, width, rows in zeros:
                copier.zero(dst, pitch, width, rows)
            if jobs:
                size = max(j.nbytes for j in jobs)
                count = min(len(jobs), self._threads + SPARE_SLOTS,
                            max(2, RING_BYTES // max(1, size)))
                ring = copier.ring(count, size)
                for _, group in itertools.groupby(jobs, key=lambda j: j.slot // FD_WINDOW):
                    window = list(group)
                    lo = window[0].slot // FD_WINDOW * FD_WINDOW
                    with self._files.window(lo, lo + FD_WINDOW) as fds:
                        run_jobs(window, fds, self._check, copier, ring, self._threads)
        finally:
            copier.finish()


def load_staged(
    shapes: Sequence[tuple[str, list[int]]], plans: Sequence[list[Run]], check: BlockCheck,
    files: BlockFiles, copier: Copier, *, threads: int = READ_WORKERS,
) -> list[mx.array]:
    """:func:`~kvstore.local.reader.load_arrays` through staging buffers and ``copier``."""
    restoring(sum(tensor_nbytes(d, s) for d, s in shapes))
    return load_tensors(
        lambda errors: StagedStream(shapes, plans, errors, check, files, copier,
                                    threads=threads), len(shapes))
