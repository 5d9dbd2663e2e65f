"""Restores in a process that restores again and again, and in a fresh one (issue 37).

Four limit rows beside the restore rows, from the page cache, verified (the default):

- ``repeated in one process``: ``Store.restore`` of the same entry again and again in
  this process (its cache dropped after each, as a server drops a request's), in rounds
  with the machine's limit: ``preadv`` + BLAKE3 of the same block files into fresh arrays,
  one thread a core, each hashing what it has just read. Held to 0.8x. This is where
  :mod:`kvstore.codecs.warm` keeps MLX's freed buffers for the next restore;
- ``..., against arrays all held``: the same restores against the same reads whose arrays
  are all kept until the call ends, in the same rounds; not held. A fresh array freed
  after its file is not fresh memory for the next file (glibc serves it again from its
  heap, at the same address: :class:`~kvstore.bench.limits.RawRead`), so the row above
  reads every file into one block of memory a thread, which stays in the L3 cache; a
  restore must deliver every array at once, whose bytes go out to memory;
- ``in a fresh process``: one ``Store.restore`` in a new process (timed inside it, after
  ``Store.open``, mlx-lm's import and MLX's first evaluation), which must fault in every
  page it fills; not held;
- ``first touch of its pages alone``: the part of that which is page faults: mapping as
  many fresh bytes and writing one byte a page, on the restore's threads, no copy.

Each row carries the minor page faults counted (``getrusage``) around its restores; the
first also the CPU time of each side (``cpu_s``, ``limit_cpu_s``: this process's, every
thread's, per run, medians), which a loaded machine does not skew as it skews the wall
times, and the load average when the rounds ended.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from ..blocks.pools import READ_WORKERS, balanced, io_pool
from .common import Row, median
from .limits import limit_row

if TYPE_CHECKING:
    from .limits import RawRead

SavedPair = Any  # io_cases.SavedPair (which imports this module: not imported back)

PAGE = mmap.PAGESIZE

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from kvstore import Namespace, Store
root, toks = sys.argv[1], json.load(open(sys.argv[2]))
ns = Namespace(model_id="kvstore-bench", config_fingerprint="synthetic")
store = Store.open(root, namespace=ns, create=False)
import mlx.core as mx
import mlx_lm.models.cache  # imported by the first restore: not the restore's own cost
mx.eval(mx.zeros((1,)))  # nor MLX's start-up
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = time.perf_counter()
cache, n = store.restore(toks, verify=True)
dt = time.perf_counter() - t
f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
assert n == len(toks)
print(json.dumps({"s": dt, "minflt": f1 - f0}))
"""


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fresh_process_restore(pair: SavedPair) -> tuple[float, int]:
    """One verified ``Store.restore`` in a new process: (seconds, minor faults)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(pair.tokens, f)
        toks = f.name
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, str(pair.root), toks],
                             check=True, capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(toks)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["s"]), int(got["minflt"])


def first_touch(nbytes: int) -> float:
    """Seconds to map ``nbytes`` of fresh memory and write one byte a page, on the
    restore's threads: the page-fault share of filling new arrays."""
    pages = -(-nbytes // PAGE)
    m = mmap.mmap(-1, pages * PAGE)
    try:
        view = memoryview(m)
        groups = balanced([PAGE] * pages, READ_WORKERS)

        def touch(idx: list[int]) -> None:
            for i in idx:
                view[i * PAGE] = 1

        t = time.perf_counter()
        futures = [io_pool().submit(touch, g) for g in groups[1:]]
        touch(groups[0])
        for fu in futures:
            fu.result()
        dt = time.perf_counter() - t
        view.release()
        return dt
    finally:
        m.close()


def warm_rows(lab: str, pair: SavedPair, raw: RawRead, reps: int) -> list[Row]:
    """The four rows of the module docstring for the entry of ``pair``."""
    from .limits import RawRead

    # the stricter limit: a new array for each file, freed after it (so, in fact, one
    # block of heap a thread: RawRead) and one thread a core, each hashing what it has
    # just read; more threads than cores only take turns on them
    strict = RawRead(pair.root, threads=os.cpu_count() or 1, fresh=True)
    # the same, each call's arrays all held until it ends, as a restore's are
    held = RawRead(pair.root, threads=os.cpu_count() or 1, fresh=True, hold=True)
    kv: list[float] = []
    lim: list[float] = []
    lim_held: list[float] = []
    cpu: dict[str, list[float]] = {"kv": [], "raw": [], "held": []}
    faults: list[int] = []
    pair.warm()
    limits = {"raw": (strict, lim), "held": (held, lim_held)}
    sides = ("raw", "kv", "held")
    for rnd in range(2 * reps + 2):  # two warm-ups: the policy raises MLX's limit at the 2nd
        for side in sides[rnd % 3:] + sides[:rnd % 3]:  # each side first in turn
            c0 = time.process_time()
            if side != "kv":
                read, times = limits[side]
                dt = read(hash=True)
                if rnd >= 2:
                    times.append(dt)
                    cpu[side].append(time.process_time() - c0)
                continue
            f0 = _minflt()
            t = time.perf_counter()
            cache, length = pair.store.restore(pair.tokens, verify=True)
            dt = time.perf_counter() - t
            f1 = _minflt()
            c1 = time.process_time()
            assert cache is not None and length == pair.n, "the benchmark entry went missing"
            del cache
            if rnd >= 2:
                kv.append(dt)
                faults.append(f1 - f0)
                cpu["kv"].append(c1 - c0)
    fresh = [fresh_process_restore(pair) for _ in range(max(2, reps // 2 + 1))]
    fresh_s = median([s for s, _ in fresh])
    fresh_faults = median([float(n) for _, n in fresh])
    touch = median([first_touch(pair.bytes) for _ in range(reps)])
    limit = median(lim)
    th = f"{strict.threads} threads, one a core"
    label = f"preadv + BLAKE3 of its block files into fresh arrays, {th}"
    extra = {"minflt_per_restore": median([float(n) for n in faults]),
             # CPU seconds of this process (every thread) per run, each side's median: on
             # a machine shared with other work the wall times say how the two sides'
             # threads fared against the neighbours' (a side with more threads wins more
             # turns on the cores); these say what each side costs
             "cpu_s": median(cpu["kv"]), "limit_cpu_s": median(cpu["raw"]),
             "held_limit_s": median(lim_held), "held_limit_cpu_s": median(cpu["held"]),
             "load_avg_1m": os.getloadavg()[0],
             "fresh_process_s": fresh_s, "fresh_process_minflt": fresh_faults,
             "first_touch_s": touch, "gb": pair.bytes / 1e9}
    base = f"restore {lab} page cache"
    return [
        limit_row(f"limit: {base}, repeated in one process", median(kv), limit, label,
                  extra=extra),
        limit_row(f"limit: {base}, repeated in one process, against arrays all held",
                  median(kv), median(lim_held),
                  "the same, each call's arrays held until it ends (as a restore's)",
                  target=None),
        limit_row(f"limit: {base}, in a fresh process", fresh_s, limit, label, target=None,
                  extra={"minflt_per_restore": fresh_faults, "gb": pair.bytes / 1e9}),
        limit_row(f"limit: {base}, in a fresh process: first touch of its pages alone",
                  touch, limit, label + " (the page-fault part of a fresh process's restore)",
                  target=None, extra={"pages": float(-(-pair.bytes // PAGE))}),
    ]
