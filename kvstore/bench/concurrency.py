"""Aggregate restore throughput with several processes restoring at once."""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time
from collections.abc import Sequence
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


class WorkerDiedError(RuntimeError):
    """A worker process ended without sending its result."""


def _exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exit code {code}"


def gather(out: Any, procs: Sequence[Any], what: str, *, timeout: float = 600.0,
           poll: float = 0.1, grace: float = 5.0) -> list[Any]:
    """One result from `out` per process in `procs`, polling their liveness: a process that
    ends without sending one raises :class:`WorkerDiedError` at once, naming `what` and its
    exit, and the others are stopped (they may wait at a barrier for it forever)."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < len(procs):
            try:
                got.append(out.get(timeout=poll))
                continue
            except queue.Empty:
                pass
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise WorkerDiedError(f"{what} died before sending its result "
                                      f"({_exit(dead[0].exitcode)}; its error is above)")
            if all(p.exitcode == 0 for p in procs):
                try:  # the last results may still be in the pipe
                    got.append(out.get(timeout=grace))
                    continue
                except queue.Empty:
                    raise WorkerDiedError(f"{what} exited (exit code 0) without sending "
                                          "its result") from None
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"{what}: no result after {timeout:.0f} s")
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
        raise
    return got


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
    times = gather(out, ps, f"a {kind} restore worker")
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
