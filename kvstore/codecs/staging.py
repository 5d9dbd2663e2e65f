"""Where a staged restore's bytes go after they are read: the copy step, behind one seam.

A restore onto a CUDA GPU (:mod:`kvstore.local.staged`) reads each block into a slot of a
ring of staging buffers, hashes it there, and hands the slot's copies to a
:class:`Copier`, which queues them and reports when the slot may be reused:

- :class:`CudaCopier`: the ring is pinned host memory, the copies run on the card's copy
  engines (``cudaMemcpy2DAsync`` on a stream of its own, one event a slot), into arrays
  whose pages were first moved to the card (``cudaMemPrefetchAsync``);
- :class:`HostCopier`: plain memory and ``memmove``, optionally deferred until the slot
  is waited for (as an asynchronous copy would be), so the ring's logic runs and is
  tested on any machine.

:func:`cuda_copier` says whether this process restores onto a CUDA GPU at all: only where
MLX's default device is a CUDA GPU whose managed memory the host and card may share.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .cudart import CudaError, Runtime, runtime

__all__ = ["Copier", "Copy", "CudaCopier", "HostCopier", "address_of", "cuda_copier", "cuda_device"]

_log = logging.getLogger("kvstore")

#: Pinned staging memory a process keeps for its restores onto a GPU, at most.
RING_BYTES = 512 << 20
#: Seconds without a restore after which the pinned ring is given back.
RING_IDLE_SECONDS = 300.0


@dataclass(frozen=True)
class Copy:
    """``height`` rows of ``width`` bytes: row ``i`` from ``src + i*spitch`` of the staging
    slot to address ``dst + i*dpitch``."""

    dst: int
    src: int
    width: int
    height: int = 1
    dpitch: int = 0
    spitch: int = 0


class Copier(Protocol):
    """The copy step of a staged restore."""

    def ring(self, count: int, nbytes: int) -> list[memoryview]:
        """``count`` staging slots of at least ``nbytes`` each, for one restore."""
        ...

    def prepare(self, spans: Sequence[tuple[int, int]]) -> None:
        """The destination memory (address, bytes) of the copies to come."""
        ...

    def zero(self, dst: int, pitch: int, width: int, height: int) -> None:
        """Zero ``height`` rows of ``width`` bytes, ``pitch`` apart from ``dst``."""
        ...

    def send(self, slot: int, copies: Sequence[Copy]) -> None:
        """Queue ``copies`` out of ring slot ``slot``; it is busy until :meth:`wait`."""
        ...

    def wait(self, slot: int) -> None:
        """Return once the copies queued from ``slot`` are done (it may then be rewritten)."""
        ...

    def finish(self) -> None:
        """Return once every queued copy is done; give the ring back."""
        ...


def address_of(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class HostCopier:
    """A :class:`Copier` in host memory (``memmove``), for machines without a GPU.

    With ``deferred`` a slot's copies run only when the slot is waited for (or at
    :meth:`finish`), as an asynchronous copy may: a pipeline that rewrote a slot
    before waiting would copy the wrong bytes. ``fail_at`` makes the n-th :meth:`send`
    (counted from 1) raise, as a copy that fails half way would.
    """

    def __init__(self, *, deferred: bool = False, fail_at: int | None = None) -> None:
        self.deferred = deferred
        self.fail_at = fail_at
        self.sent = 0
        self.waits = 0
        self.prepared: list[tuple[int, int]] = []
        self._bufs: list[bytearray] = []
        self._addrs: list[int] = []
        self._pending: dict[int, list[Copy]] = {}
        self._lock = threading.Lock()

    def ring(self, count: int, nbytes: int) -> list[memoryview]:
        self._bufs = [bytearray(max(1, nbytes)) for _ in range(count)]
        views = [memoryview(b) for b in self._bufs]
        self._addrs = [address_of(v) for v in views]
        return views

    def prepare(self, spans: Sequence[tuple[int, int]]) -> None:
        self.prepared = list(spans)

    def zero(self, dst: int, pitch: int, width: int, height: int) -> None:
        for i in range(height):
            ctypes.memset(dst + i * pitch, 0, width)

    def send(self, slot: int, copies: Sequence[Copy]) -> None:
        with self._lock:
            self.sent += 1
            if self.fail_at is not None and self.sent == self.fail_at:
                raise CudaError("cudaMemcpy2DAsync", 700, "an illegal memory access (injected)")
            if self.deferred:
                self._pending.setdefault(slot, []).extend(copies)
                return
        self._run(slot, copies)

    def _run(self, slot: int, copies: Sequence[Copy]) -> None:
        base = self._addrs[slot]
        for c in copies:
            for i in range(c.height):
                ctypes.memmove(c.dst + i * c.dpitch, base + c.src + i * c.spitch, c.width)

    def wait(self, slot: int) -> None:
        with self._lock:
            self.waits += 1
            todo = self._pending.pop(slot, [])
        self._run(slot, todo)

    def finish(self) -> None:
        for slot in list(self._pending):
            self.wait(slot)


class _Ring:
    """Pinned buffers kept for the process's restores, given back after an idle spell."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.busy = False
        self.ptrs: list[int] = []
        self.size = 0
        self._timer: threading.Timer | None = None
        self._generation = 0

    def take(self, rt: Runtime, count: int, nbytes: int) -> tuple[list[int], bool]:
        """``count`` pinned buffers of ``nbytes``; the bool says they are the kept ones
        (to be handed back with :meth:`give`), else they are this restore's own."""
        with self.lock:
            if not self.busy:
                self.busy = True
                if self.size < nbytes or len(self.ptrs) < count:
                    self._free_locked(rt)
                    self.size = nbytes
                    self.ptrs = _pinned(rt, count, nbytes)
                return self.ptrs[:count], True
        return _pinned(rt, count, nbytes), False

    def give(self, rt: Runtime) -> None:
        with self.lock:
            self.busy = False
            if self._timer is not None:
                self._timer.cancel()
            self._generation += 1
            t = threading.Timer(RING_IDLE_SECONDS, self._idle, args=(rt, self._generation))
            t.daemon = True
            t.name = "kvstore-pinned-ring"
            self._timer = t
            t.start()

    def _idle(self, rt: Runtime, gen: int) -> None:
        with self.lock:
            if gen == self._generation and not self.busy:
                self._free_locked(rt)

    def _free_locked(self, rt: Runtime) -> None:
        for p in self.ptrs:
            rt.free_host(p)
        self.ptrs, self.size = [], 0


_RING = _Ring()
_SETUP = threading.local()


def _pinned(rt: Runtime, count: int, nbytes: int) -> list[int]:
    t = time.perf_counter()
    try:
        return [rt.host_alloc(nbytes) for _ in range(count)]
    finally:
        _SETUP.seconds = getattr(_SETUP, "seconds", 0.0) + time.perf_counter() - t


def setup_seconds() -> float:
    """Seconds this thread's restores spent pinning staging memory since the last call (a
    cost of the first restore of a process, or of the first after an idle spell, not of
    the bytes restored: a rate measured from a restore leaves it out)."""
    got = getattr(_SETUP, "seconds", 0.0)
    _SETUP.seconds = 0.0
    return float(got)


class CudaCopier:
    """A :class:`Copier` onto a CUDA GPU (module docstring). One per restore."""

    def __init__(self, rt: Runtime, device: int) -> None:
        self.rt = rt
        self.device = device
        self.stream = _stream(rt)
        self._ptrs: list[int] = []
        self._kept = False
        self._events: list[int] = []
        self._sent: list[bool] = []
        self._host: HostCopier | None = None  # where the arrays are not managed memory

    def ring(self, count: int, nbytes: int) -> list[memoryview]:
        self._ptrs, self._kept = _RING.take(self.rt, count, nbytes)
        self._events = [self.rt.event() for _ in range(count)]
        self._sent = [False] * count
        return [memoryview((ctypes.c_char * nbytes).from_address(p)).cast("B")
                for p in self._ptrs]

    def prepare(self, spans: Sequence[tuple[int, int]]) -> None:
        if spans and not self.rt.is_managed(spans[0][0]):
            # not the managed memory MLX 0.32 gives its CPU-stream arrays (another MLX):
            # the host can write it, the card's engines may not; copied on the host instead
            _log.warning("kvstore: restored arrays are not CUDA managed memory; filled on "
                         "the host")
            self._host = HostCopier()
            return
        for ptr, nbytes in spans:
            if nbytes:
                self.rt.prefetch(ptr, nbytes, self.device, self.stream)

    def zero(self, dst: int, pitch: int, width: int, height: int) -> None:
        if self._host is not None:
            self._host.zero(dst, pitch, width, height)
            return
        self.rt.zero_2d(dst, pitch, width, height, self.stream)

    def send(self, slot: int, copies: Sequence[Copy]) -> None:
        base = self._ptrs[slot]
        if self._host is not None:
            for c in copies:
                for i in range(c.height):
                    ctypes.memmove(c.dst + i * c.dpitch, base + c.src + i * c.spitch, c.width)
            return
        for c in copies:
            if c.height == 1 or (c.dpitch == c.width and c.spitch == c.width):
                self.rt.copy(c.dst, base + c.src, c.width * c.height, self.stream)
            else:
                self.rt.copy_2d(c.dst, c.dpitch, base + c.src, c.spitch, c.width, c.height,
                                self.stream)
        self.rt.record(self._events[slot], self.stream)
        self._sent[slot] = True

    def wait(self, slot: int) -> None:
        if self._sent[slot]:
            self.rt.wait_event(self._events[slot])
            self._sent[slot] = False

    def finish(self) -> None:
        try:
            self.rt.sync_stream(self.stream)
        finally:
            for e in self._events:
                self.rt.destroy_event(e)
            self._events = []
            if self._kept:
                _RING.give(self.rt)
            else:
                for p in self._ptrs:
                    self.rt.free_host(p)
            self._ptrs = []


_STREAMS: dict[int, int] = {}
_STREAM_LOCK = threading.Lock()


def _stream(rt: Runtime) -> int:
    """The process's copy stream (one: its copies are ordered, and it is made once)."""
    with _STREAM_LOCK:
        if os.getpid() not in _STREAMS:
            _STREAMS[os.getpid()] = rt.stream()
        return _STREAMS[os.getpid()]


_TARGET: dict[str, tuple[Runtime, int] | None] = {}


def cuda_device() -> tuple[Runtime, int] | None:
    """(runtime, device) of MLX's CUDA GPU whose managed memory host and card may share at
    once; None where there is none (looked up once a process)."""
    if "t" in _TARGET:
        return _TARGET["t"]
    found: tuple[Runtime, int] | None = None
    try:
        import mlx.core as mx

        cuda = getattr(mx, "cuda", None)
        if cuda is not None and cuda.is_available():
            rt = runtime()
            if rt is not None:
                info = rt.device_info()
                if info.concurrent_managed:
                    found = (rt, info.device)
    except (CudaError, AttributeError, RuntimeError, ValueError) as e:
        _log.warning("kvstore: restores stay on the host: %s", e)
    _TARGET["t"] = found
    return found


def cuda_copier() -> CudaCopier | None:
    """A copier onto this process's CUDA GPU, or None where restores stay on the host: MLX's
    default device is not a CUDA GPU (a CPU, Apple silicon), or ``KVSTORE_GPU_RESTORE=0``."""
    if os.environ.get("KVSTORE_GPU_RESTORE", "1") == "0":
        return None
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return None
    target = cuda_device()
    return None if target is None else CudaCopier(*target)
