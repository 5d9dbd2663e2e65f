"""Aggregate restore throughput with several processes restoring at once."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from .common import Config, Row


def _worker(kind: str, root: str, file: str, tokens: list[int], reps: int, barrier: Any,
            out: Any) -> None:
    """One process: warm up, wait for the others, restore ``reps`` times, report seconds."""
    import mlx.core as mx

    from ..store import Store
    from .common import decode_step
    from .io_cases import NS, load_prompt_cache

    store = Store.open(root, namespace=NS, create=False) if kind == "kv" else None

    def once() -> None:
        if store is not None:
            cache, _ = store.restore(tokens)
            assert cache is not None
        else:
            cache = load_prompt_cache(file)
            mx.eval([c.state for c in cache])
        decode_step(cache)

    once()
    barrier.wait()
    t = time.perf_counter()
    for _ in range(reps):
        once()
    out.put(time.perf_counter() - t)
    if store is not None:
        store.close()


def _aggregate(kind: str, root: Path, file: Path, tokens: list[int], nbytes: int, procs: int,
               reps: int) -> float:
    """GB/s restored by ``procs`` processes together (wall time of the slowest)."""
    ctx = mp.get_context("spawn")  # mlx and LMDB do not survive a fork
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(kind, str(root), str(file), tokens, reps, barrier, out))
          for _ in range(procs)]
    for p in ps:
        p.start()
    times = [out.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a {kind} restore worker failed (exit code {p.exitcode})")
    return float(procs * reps * nbytes / max(times) / 1e9)


def concurrency_rows(cfg: Config, root: Path, file: Path, tokens: list[int], nbytes: int
                     ) -> list[Row]:
    """kvstore vs load_prompt_cache, 1..n processes, files in the page cache."""
    rows = []
    for procs in cfg.procs:
        kv = ml = 0.0
        kvs: list[float] = []
        mls: list[float] = []
        for rnd in range(2):  # A B B A
            order = ("kv", "ml") if rnd == 0 else ("ml", "kv")
            for kind in order:
                gbs = _aggregate(kind, root, file, tokens, nbytes, procs, cfg.conc_reps)
                (kvs if kind == "kv" else mls).append(gbs)
        kv, ml = sum(kvs) / len(kvs), sum(mls) / len(mls)
        rows.append(Row("concurrency", f"restore throughput, {procs} process(es)", "GB/s", kv, ml,
                        "mlx-lm load_prompt_cache", "throughput"))
    return rows
