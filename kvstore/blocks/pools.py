"""The process's I/O threads (block writes and hashes, block reads) and how work is spread
over them.

Hashing, ``pwritev``/``preadv`` and ``fsync`` release the GIL, so threads run them in
parallel. The sizes and why: docs/BENCHMARKS.md, "Pool sizes" (``tools/probe_io.py``).
One pool each per process, made again after a fork: creating threads per save costs
more than a small save's work.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

__all__ = ["IO_WORKERS", "READ_WORKERS", "balanced", "io_pool", "read_pool"]

#: Hashing and page-cache writes keep a core busy each: one thread a core, at most 8.
IO_WORKERS = max(2, min(8, os.cpu_count() or 2))
#: Reads mostly wait on the device and a verified read hashes what it read: three in
#: flight a core, at most 16.
READ_WORKERS = max(4, min(16, 3 * (os.cpu_count() or 2)))
_POOLS: dict[str, tuple[int, ThreadPoolExecutor]] = {}
_POOL_LOCK = threading.Lock()


def _pool(name: str, workers: int) -> ThreadPoolExecutor:
    with _POOL_LOCK:
        got = _POOLS.get(name)
        if got is None or got[0] != os.getpid():
            got = _POOLS[name] = (os.getpid(), ThreadPoolExecutor(
                workers, thread_name_prefix=f"kvstore-{name}"))
        return got[1]


def io_pool() -> ThreadPoolExecutor:
    """The process's block write/hash threads (``IO_WORKERS`` of them)."""
    return _pool("io", IO_WORKERS)


def read_pool() -> ThreadPoolExecutor:
    """The process's block read threads (``READ_WORKERS`` of them)."""
    return _pool("read", READ_WORKERS)


def balanced(sizes: Sequence[int], n: int) -> list[list[int]]:
    """Indexes of ``sizes`` in at most ``n`` groups of about equal totals: biggest first,
    each to the lightest group so far (empty groups are left out)."""
    groups: list[list[int]] = [[] for _ in range(max(1, n))]
    loads = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        k = loads.index(min(loads))
        groups[k].append(i)
        loads[k] += sizes[i]
    return [g for g in groups if g]
