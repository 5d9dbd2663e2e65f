"""Bun.hash throughput against hashlib.sha256 on the same buffer, same run; and its
pure-Python port (the fallback when the C extension could not be built) against it.

Usage: python tools/bench_bunhash.py [--mib 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Callable

import mlx.core as mx

from kvstore.formats.bunhash import bun_hash


def _best_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    """Print GB/s for Bun.hash (bytes and an MLX array) and sha256, and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256, help="buffer size in MiB")
    ap.add_argument("--repeat", type=int, default=5, help="runs per function (best is kept)")
    args = ap.parse_args()

    n = args.mib << 20
    data = os.urandom(n)
    arr = mx.random.normal((n // 2,)).astype(mx.bfloat16)
    mx.eval(arr)
    view = memoryview(arr)  # type: ignore[arg-type]  # mlx arrays export the buffer protocol

    rows = {
        "bun_hash(bytes)": _best_seconds(lambda: bun_hash(data), args.repeat),
        "bun_hash(mlx bf16 memoryview)": _best_seconds(lambda: bun_hash(view), args.repeat),
        "hashlib.sha256(bytes)": _best_seconds(lambda: hashlib.sha256(data).digest(), args.repeat),
    }
    sha = rows["hashlib.sha256(bytes)"]
    print(f"buffer: {args.mib} MiB, best of {args.repeat}")
    for name, secs in rows.items():
        print(f"{name:32s} {n / secs / 1e9:8.2f} GB/s   {sha / secs:6.2f}x sha256")
    # the pure-Python port (no C compiler at install), on the first 16 MiB: it is slow
    from kvstore.formats import wyhash_python

    part = memoryview(data)[: min(n, 16 << 20)]
    secs = _best_seconds(lambda: wyhash_python.hash(part), max(1, args.repeat // 2))
    c = _best_seconds(lambda: bun_hash(part), args.repeat)
    print(f"{'pure-Python port (bytes)':32s} {len(part) / secs / 1e9:8.3f} GB/s   "
          f"{c / secs:8.5f}x the extension, on {len(part) >> 20} MiB")


if __name__ == "__main__":
    main()
