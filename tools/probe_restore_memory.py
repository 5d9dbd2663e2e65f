"""What bounds a restore from the page cache: the copy, or the fresh memory it copies into?

    python tools/probe_restore_memory.py [--tokens 4096] [--reps 7] [--json FILE]

On the benchmark's cache (bf16, 16 layers, 8 KV heads, head dim 128), side by side in
A B C D rounds, all with the restore's read threads:

- ``restore``: ``Store.restore(verify=False)`` from the page cache;
- ``preadv, warm memory``: the bench's limit row: ``preadv`` of every block file into
  arrays allocated and touched once, before the timing;
- ``preadv, fresh memory``: the same reads into memory allocated inside the timing
  (as a restore must: it hands out new arrays), so the kernel faults in and zeroes
  every page on first touch: anonymous maps of 4 KiB pages (as MLX's allocator gets
  from malloc), and the same maps advised ``MADV_HUGEPAGE`` (as NumPy does for large
  arrays; where transparent huge pages are ``madvise``, the default, only those get them);
- ``first touch alone``: mapping the same bytes and writing one byte per 4 KiB page, in
  the same threads: the page-fault cost without any copy.

Nothing here changes kvstore; it says which part of the restore's gap to its limit row
is the machine's cost of new memory.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvstore import Store
from kvstore.bench.common import QUICK, block_files, make_cache
from kvstore.bench.io_cases import NS, tokens_for
from kvstore.blocks.pools import READ_WORKERS as THREADS
from kvstore.blocks.pools import balanced

PAGE = 4096


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    pool = ThreadPoolExecutor(THREADS)
    with tempfile.TemporaryDirectory(prefix="probe-restore-") as tmp:
        root = Path(tmp)
        toks = tokens_for(a.tokens, seed=1)
        store = Store.open(root, namespace=NS, durable=False, create=True)
        store.save(toks, make_cache(QUICK, a.tokens, seed=1))
        paths = [str(x) for x in block_files(root)]
        sizes = [os.stat(x).st_size for x in paths]
        groups = balanced(sizes, THREADS)
        warm = [np.ones(s, dtype=np.uint8) for s in sizes]

        def read_into(bufs: list[Any], idx: list[int]) -> None:
            for i in idx:
                fd = os.open(paths[i], os.O_RDONLY)
                try:
                    assert os.preadv(fd, [memoryview(bufs[i])], 0) == sizes[i]
                finally:
                    os.close(fd)

        def spread(fn: Any) -> float:
            t = time.perf_counter()
            list(pool.map(fn, groups))
            return time.perf_counter() - t

        def restore() -> float:
            t = time.perf_counter()
            cache, n = store.restore(toks, verify=False)
            assert cache is not None and n == a.tokens
            return time.perf_counter() - t

        def fresh(huge: bool) -> float:
            t = time.perf_counter()
            bufs = [mmap.mmap(-1, s) for s in sizes]
            if huge:
                for b in bufs:
                    b.madvise(mmap.MADV_HUGEPAGE)
            list(pool.map(lambda g: read_into(bufs, g), groups))
            dt = time.perf_counter() - t
            for b in bufs:
                b.close()
            return dt

        def touch(idx: list[int], bufs: list[Any]) -> None:
            for i in idx:
                np.frombuffer(bufs[i], dtype=np.uint8)[::PAGE] = 1

        def touch_only() -> float:
            t = time.perf_counter()
            bufs = [mmap.mmap(-1, s) for s in sizes]
            list(pool.map(lambda g: touch(g, bufs), groups))
            dt = time.perf_counter() - t
            for b in bufs:
                b.close()
            return dt

        cases = {"restore (verify=False)": restore,
                 "preadv, warm memory (the limit row)": lambda: spread(
                     lambda g: read_into(warm, g)),
                 "preadv, fresh 4 KiB pages": lambda: fresh(False),
                 "preadv, fresh huge pages (madvised)": lambda: fresh(True),
                 "first touch of 4 KiB pages alone (no copy)": touch_only}
        got: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(a.reps + 1):
            order = list(cases.items()) if r % 2 == 0 else list(cases.items())[::-1]
            for k, fn in order:
                dt = fn()
                if r:
                    got[k].append(dt)
        store.close()
    nbytes = sum(sizes)
    out = {"tokens": a.tokens, "bytes": nbytes, "threads": THREADS, "cpus": os.cpu_count(),
           "load": os.getloadavg(), "ms": {k: statistics.median(v) * 1e3 for k, v in got.items()}}
    print(f"{a.tokens} tokens, {nbytes / 2**20:.0f} MiB in {len(sizes)} block files, "
          f"{THREADS} threads, {os.cpu_count()} CPUs, load {out['load'][0]:.2f}")
    for k, ms in out["ms"].items():
        print(f"  {k:<40} {ms:8.1f} ms  {nbytes / ms / 1e6:6.2f} GB/s")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
