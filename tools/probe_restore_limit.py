"""Which limit is a repeated restore's? The variants of a raw read + BLAKE3 side by side.

    python tools/probe_restore_limit.py [--tokens 4096] [--reps 11]

On the benchmark's cache (bf16, 16 layers, 8 KV heads of 128: 256 MiB at 4k tokens),
in interleaved rounds (A B C ..., the order reversed every other round), medians after
two warm-up rounds:

- ``restore``: ``Store.restore`` (verified) of the same entry again and again in this
  process, each cache dropped after it (the bench's ``repeated in one process`` row);
  with ``--threads 2,6``, also ``restore, N threads``: the same with its read split
  over N threads instead of the ones ``kvstore.local.reader.read_threads`` picks (its
  ``READ_WORKERS`` and ``CACHED_THREADS`` patched for that side alone);
- ``raw``: ``preadv`` + BLAKE3 of its block files, in each of the ways a limit could be
  taken: one thread a core or the restore's read threads; into arrays allocated once
  (``reused``) or new ones each time (``fresh``: NumPy's, their pages faulted in); each
  file hashed after it is read whole (``whole``) or a chunk at a time as it is read
  (``chunk``, while the chunk is in the core's cache); ``fresh held``: fresh arrays all
  kept until the run ends, as a restore's are (a fresh array freed after its file is
  served again from glibc's heap for the next file: the same memory, warm in the L3).

The limit a restore is held to is the fastest of these the machine can do with the
memory a restore gets. Each side's CPU time (this process's, every thread's, median) is
printed beside its wall time: on a machine shared with other work the wall times say how
each side's threads fared against the neighbours', the CPU times what each side costs.
Nothing here changes kvstore.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import numpy as np

from kvstore import Store
from kvstore.bench.common import QUICK, block_files, make_cache
from kvstore.bench.io_cases import NS, tokens_for
from kvstore.blocks.pools import READ_WORKERS, balanced

CHUNK = 1 << 20


def raw_read(paths: list[str], threads: int, *, fresh: bool, chunk: bool, hold: bool = False
             ) -> Callable[[], float]:
    sizes = [os.stat(p).st_size for p in paths]
    reused = [np.ones(s, np.uint8) for s in sizes]
    pool = ThreadPoolExecutor(threads)

    def job(idx: list[int]) -> list[np.ndarray]:
        held = []
        for i in idx:
            arr = np.empty(sizes[i], np.uint8) if fresh else reused[i]
            if hold:
                held.append(arr)
            view = memoryview(arr)  # type: ignore[arg-type]
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                if chunk:
                    h = blake3.blake3()
                    for pos in range(0, sizes[i], CHUNK):
                        part = view[pos : pos + CHUNK]
                        os.preadv(fd, [part], pos)
                        h.update(part)
                    h.digest()
                else:
                    os.preadv(fd, [view], 0)
                    blake3.blake3(view).digest()
            finally:
                os.close(fd)
        return held

    def run() -> float:
        groups = balanced(sizes, threads)
        t = time.perf_counter()
        held = [f.result() for f in [pool.submit(job, g) for g in groups]]
        dt = time.perf_counter() - t
        del held
        return dt

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", default="", metavar="N,N",
                    help="also restore with its read split over each of these thread counts")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="probe-limit-"))
    try:
        cache = make_cache(QUICK, args.tokens, seed=1)
        toks = tokens_for(args.tokens, seed=args.tokens)
        with Store.open(scratch / "root", namespace=NS) as s:
            s.save(toks, cache)
        del cache
        store = Store.open(scratch / "root", namespace=NS, create=False)
        paths = [str(p) for p in block_files(scratch / "root")]
        cores = os.cpu_count() or 1

        def restore() -> float:
            t = time.perf_counter()
            c, n = store.restore(toks, verify=True)
            dt = time.perf_counter() - t
            assert c is not None and n == args.tokens
            return dt

        sides: dict[str, Callable[[], float]] = {"restore": restore}
        from kvstore.local import reader

        def restore_on(n: int) -> float:
            keep = reader.READ_WORKERS, reader.CACHED_THREADS
            reader.READ_WORKERS = reader.CACHED_THREADS = n
            try:
                return restore()
            finally:
                reader.READ_WORKERS, reader.CACHED_THREADS = keep

        for n in [int(x) for x in args.threads.split(",") if x.strip()]:
            sides[f"restore, {n} threads"] = functools.partial(restore_on, n)
        for threads in sorted({cores, READ_WORKERS}):
            for fresh in (False, True):
                for chunk in (False, True):
                    name = (f"raw, {threads} threads, {'fresh' if fresh else 'reused'}, "
                            f"{'chunk' if chunk else 'whole'}")
                    sides[name] = raw_read(paths, threads, fresh=fresh, chunk=chunk)
            sides[f"raw, {threads} threads, fresh held, chunk"] = raw_read(
                paths, threads, fresh=True, chunk=True, hold=True)
        res: dict[str, list[float]] = {k: [] for k in sides}
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        for rnd in range(args.reps + 2):
            order = list(sides.items())
            for name, fn in order if rnd % 2 else order[::-1]:
                c0 = time.process_time()
                dt = fn()
                if rnd >= 2:
                    res[name].append(dt)
                    cpu[name].append(time.process_time() - c0)
        store.close()
        kv = statistics.median(res["restore"])
        print(f"load average {os.getloadavg()[0]:.2f}, {cores} cores, read threads "
              f"{READ_WORKERS}, {args.tokens} tokens")
        for name, xs in res.items():
            m = statistics.median(xs)
            c = statistics.median(cpu[name])
            print(f"{name:40s} {m * 1e3:8.1f} ms  (min {min(xs) * 1e3:7.1f}, CPU "
                  f"{c * 1e3:6.1f} ms)  restore at {m / kv:.2f}x of it")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
