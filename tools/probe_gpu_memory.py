"""Where can a restore onto a CUDA GPU land its copies, and at what speed? (no MLX arrays)

    python tools/probe_gpu_memory.py [--gib 4]

Through the CUDA runtime kvstore uses (``kvstore.codecs.cudart``), one buffer of
``--gib`` GiB each, medians not needed (one copy of GiBs is steady):

- host to device from pinned memory into device memory (``cudaMalloc``): the link;
- into managed memory (``cudaMallocManaged``, what MLX's CPU-stream arrays are): fresh and
  first moved to the card (``cudaMemPrefetchAsync``), fresh without that, already on the
  card, and written by the host first (as a restore on the host leaves it); after each,
  a device-to-device read of it, which runs at the card's memory speed only where its
  pages are on the card (else the read pulls them across as demand faults);
- the same bytes as 512 KiB copies, one call each, 1-D and 2-D (8 rows of 64 KiB), as a
  staged restore issues them.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable

from kvstore.codecs.cudart import runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=4)
    size = ap.parse_args().gib << 30
    rt = runtime()
    if rt is None:
        raise SystemExit("no CUDA runtime here")
    info = rt.device_info()
    print(info)
    lib = rt._lib
    lib.cudaMallocManaged.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                      ctypes.c_uint]
    s = rt.stream()
    gb = size / 1e9

    def managed() -> int:
        p = ctypes.c_void_p()
        if lib.cudaMallocManaged(ctypes.byref(p), size, 1):
            raise SystemExit("cudaMallocManaged failed")
        assert p.value is not None
        return p.value

    def row(name: str, fn: Callable[[], None]) -> None:
        rt.sync_stream(s)
        t = time.perf_counter()
        fn()
        rt.sync_stream(s)
        dt = time.perf_counter() - t
        print(f"{name:55s} {dt * 1e3:8.1f} ms  {gb / dt:7.1f} GB/s", flush=True)

    t = time.perf_counter()
    pinned = rt.host_alloc(size)
    print(f"cudaHostAlloc {size >> 30} GiB: {time.perf_counter() - t:.3f} s")
    ctypes.memset(pinned, 7, size)
    dev, dev2 = rt.malloc(size), rt.malloc(size)
    row("h2d pinned -> device", lambda: rt.copy(dev, pinned, size, s))
    row("d2d device -> device", lambda: rt.copy(dev2, dev, size, s))
    m = managed()
    row("managed fresh: prefetch to the card", lambda: rt.prefetch(m, size, info.device, s))
    row("managed prefetched: h2d", lambda: rt.copy(m, pinned, size, s))
    row("managed prefetched: d2d read", lambda: rt.copy(dev2, m, size, s))
    m2 = managed()
    row("managed fresh, not prefetched: h2d", lambda: rt.copy(m2, pinned, size, s))
    m3 = managed()
    ctypes.memset(m3, 1, size)
    row("managed written by the host: d2d read (demand faults)",
        lambda: rt.copy(dev2, m3, size, s))
    m4 = managed()
    ctypes.memset(m4, 1, size)
    row("managed written by the host: prefetch (migration)",
        lambda: rt.prefetch(m4, size, info.device, s))
    piece = 512 << 10
    n = size // piece

    def many_1d() -> None:
        for i in range(n):
            rt.copy(dev + i * piece, pinned + i * piece, piece, s)

    def many_2d(dst: int) -> Callable[[], None]:
        def go() -> None:
            for i in range(n):
                rt.copy_2d(dst + (i // 2) * (1 << 20) + (i % 2) * (64 << 10), 128 << 10,
                           pinned + i * piece, 64 << 10, 64 << 10, 8, s)
        return go

    row(f"h2d as {n} 1-D copies of 512 KiB", many_1d)
    row(f"h2d as {n} 2-D copies (8 x 64 KiB)", many_2d(dev))
    row(f"managed prefetched: {n} 2-D copies", many_2d(m))


if __name__ == "__main__":
    main()
