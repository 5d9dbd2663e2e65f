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

    python tools/probe_restore_memory.py --peak [--tokens 16384] [--layers 32]

measures instead the peak memory of one restore (issue 37): a fresh process opens the
root, notes its resident memory, resets its high-water mark (``/proc/self/clear_refs``)
and restores the entry, verified and then not (each in a process of its own); the peak
above what it held before, against the cache's own bytes. The default shape with
``--layers 32`` is Llama-3-8B's KV cache (8 KV heads of 128, bfloat16).
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
    p.add_argument("--peak", action="store_true", help="peak memory of one restore instead")
    p.add_argument("--layers", type=int, default=QUICK.layers)
    a = p.parse_args(argv)
    if a.peak:
        return peak(a.tokens, a.layers, a.json)
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


_CHILD = r"""
import json, sys
from kvstore import Store
from kvstore.bench.io_cases import NS, tokens_for

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)

root, n, verify = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
store = Store.open(root, namespace=NS, create=False)
toks = tokens_for(n, seed=1)
import mlx.core as mx
mx.eval(mx.zeros((1,)))  # MLX's own start-up is not the restore's
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark starts again from here
cache, got = store.restore(toks, verify=verify)
assert got == n
mx.eval([c.state for c in cache])
print(json.dumps({"before": before, "hwm": status("VmHWM"), "after": status("VmRSS")}))
"""


def peak(tokens: int, layers: int, json_path: str | None) -> int:
    """One restore's peak memory in a fresh process, verified and not (see the module)."""
    import dataclasses
    import subprocess

    from kvstore.bench.common import cache_bytes

    cfg = dataclasses.replace(QUICK, layers=layers)
    with tempfile.TemporaryDirectory(prefix="probe-peak-") as tmp:
        root = Path(tmp)
        cache = make_cache(cfg, tokens, seed=1)
        nbytes = cache_bytes(cache)
        with Store.open(root, namespace=NS, durable=False, create=True) as store:
            store.save(tokens_for(tokens, seed=1), cache)
        del cache
        out: dict[str, Any] = {"tokens": tokens, "layers": layers, "cache_bytes": nbytes}
        print(f"{tokens} tokens, {layers} layers: the cache is {nbytes / 2**20:.0f} MiB")
        for verify in (True, False):
            got = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(tokens),
                                  "1" if verify else "0"], check=True, capture_output=True,
                                 text=True, timeout=600)
            r = json.loads(got.stdout.strip().splitlines()[-1])
            over = r["hwm"] - r["before"]
            out["verified" if verify else "unverified"] = r
            print(f"  {'verified' if verify else 'verify_reads=False'}: peak "
                  f"{over / 2**20:.0f} MiB above the process before it, "
                  f"{(over - nbytes) / 2**20:+.0f} MiB beside the cache's own; "
                  f"held after: {(r['after'] - r['before']) / 2**20:.0f} MiB")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
