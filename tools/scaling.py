"""How each of kvstore's costs grows with its work: the data behind docs/BENCHMARKS.md's curves.

    python tools/scaling.py [save-restore] [verify] [lookup] [compact] [--json FILE] [--quick]
    python tools/plot_scaling.py FILE          # the PNGs in docs/

- ``save-restore``: save (durable and not) and restore (page cache, after
  eviction) of the benchmark's cache (16 layers, 8 KV heads, head dim 128,
  bfloat16) at 1k to 32k tokens (64 MiB to 2 GiB).
- ``verify``: ``Store.verify(read_data=True)`` of those same roots, from the
  page cache, against their bytes (each root's blocks are hashed again).
- ``lookup``: p50/p99 of a 32k-token query against 1k to 1M entries, the index
  built by ``tools/fast_root.py`` (a save of each entry would take ~30 min at 1M),
  and the p50 of the same index reads alone (``Store.lookup_reads`` replayed as
  plain gets, as the bench's lookup limit row does).
- ``compact``: ``Store.compact(grace=0)`` of roots with 10k to 1M blocks
  (``tools/fast_root.py``), a tenth of their entries deleted first, so the
  sweep has real garbage to unlink; once with the number of blocks growing at
  16 blocks an entry, and once with the number of entries growing at a fixed
  100k blocks.

Only kvstore's public API is timed (``Store.open/save/lookup/restore/compact/
verify/delete``). Every point is a median of ``--reps`` runs after one warm-up,
the sides of a size interleaved. Without ``--json`` the figures are printed only;
with it, they are merged into FILE (groups not run are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvstore import Namespace, Store

sys.path.insert(0, str(Path(__file__).resolve().parent))

NS = Namespace(model_id="kvstore-scaling", config_fingerprint="synthetic")
LAYERS, HEADS, DIM = 16, 8, 128
TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)
ENTRIES = (1000, 10_000, 100_000, 1_000_000)
BLOCKS = (10_000, 30_000, 100_000, 300_000, 1_000_000)
ENTRIES_AT_100K = (1000, 6250, 25_000, 100_000)


def _interleave(sides: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    out: dict[str, list[float]] = {k: [] for k in sides}
    for rnd in range(reps + 1):
        order = list(sides.items())
        if rnd % 2:
            order.reverse()
        for k, fn in order:
            dt = fn()
            if rnd:
                out[k].append(dt)
    return {k: statistics.median(v) for k, v in out.items()}


def _cache(n: int, seed: int) -> list[Any]:
    cache = [KVCache() for _ in range(LAYERS)]
    for pos in range(0, n, 2048):
        m = min(2048, n - pos)
        for li, c in enumerate(cache):
            k1, k2 = mx.random.split(mx.random.key(seed * 1_000_003 + li * 7919 + pos))
            shape = (1, HEADS, m, DIM)
            c.update_and_fetch(mx.random.normal(shape, key=k1).astype(mx.bfloat16),
                               mx.random.normal(shape, key=k2).astype(mx.bfloat16))
        mx.eval([c.keys for c in cache] + [c.values for c in cache])
    return cache


def _blocks(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, fs in os.walk(root / "blocks") for f in fs]


def _drop(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass


def save_restore(scratch: Path, reps: int, max_tokens: int, verify: bool) -> dict[str, Any]:
    """Save and restore (and verify) time against tokens, one cache per size."""
    points: list[dict[str, float]] = []
    for n in [t for t in TOKENS if t <= max_tokens]:
        cache = _cache(n, seed=n)
        toks = list(range(n))
        nbytes = sum(c.keys[..., :n, :].nbytes + c.values[..., :n, :].nbytes for c in cache)

        def save(durable: bool, cache: list[Any] = cache, toks: list[int] = toks) -> float:
            root = Path(tempfile.mkdtemp(prefix="save-", dir=scratch))
            try:
                with Store.open(root, namespace=NS, durable=durable) as store:
                    os.sync()
                    t = time.perf_counter()
                    store.save(toks, cache)
                    return time.perf_counter() - t
            finally:
                shutil.rmtree(root)

        saves = _interleave({"save durable": lambda: save(True),
                             "save non-durable": lambda: save(False)}, reps)
        root = Path(tempfile.mkdtemp(prefix="restore-", dir=scratch))
        store = Store.open(root, namespace=NS)
        store.save(toks, cache)
        del cache
        files = _blocks(root)

        def restore(cold: bool, store: Store = store, files: list[Path] = files,
                    toks: list[int] = toks) -> float:
            if cold:
                _drop(files)
            t = time.perf_counter()
            c, length = store.restore(toks)
            assert c is not None and length == len(toks)
            return time.perf_counter() - t

        def verify_all(store: Store = store, files: list[Path] = files) -> float:
            _warm(files)
            t = time.perf_counter()
            rep = store.verify(read_data=True)
            dt = time.perf_counter() - t
            assert rep.sound
            return dt

        _warm(files)
        sides: dict[str, Callable[[], float]] = {
            "restore page cache": lambda: restore(False),
            "restore after eviction": lambda: restore(True),
        }
        if verify:
            sides["verify read_data"] = verify_all
        res = _interleave(sides, reps)
        store.close()
        shutil.rmtree(root)
        point = {"tokens": float(n), "bytes": float(nbytes), **saves, **res}
        points.append(point)
        print(f"  {n} tokens ({nbytes / 2**20:.0f} MiB): "
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in point.items()
                          if k not in ("tokens", "bytes")), flush=True)
    return {"points": points, "layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM}


def lookup(scratch: Path, reps: int, max_entries: int) -> dict[str, Any]:
    """Lookup p50/p99 of a 32k-token query as the index grows (built, not saved)."""
    from fast_root import LookupIndexBuilder

    root = Path(tempfile.mkdtemp(prefix="lookup-", dir=scratch))
    builder = LookupIndexBuilder(root, NS)
    points = []
    try:
        for n in [e for e in ENTRIES if e <= max_entries]:
            t0 = time.perf_counter()
            builder.grow_to(n)
            build_s = time.perf_counter() - t0
            with Store.open(root, namespace=NS, create=False, durable=False) as store:
                qs = builder.queries(max(200, reps * 100), 32768)
                for q, _ in qs[:20]:
                    store.lookup(q)
                times = []
                for q, want in qs:
                    t = time.perf_counter()
                    m = store.lookup(q)
                    times.append(time.perf_counter() - t)
                    assert m is not None and m.length >= want, "lookup missed a stored prefix"
                # what grows with the entries: the index reads (bench's lookup limit row)
                traces = [store.lookup_reads(q) for q, _ in qs[:100]]
                gets = [len(r) for r in traces]
                raw = []
                for r in traces:
                    t = time.perf_counter()
                    store.replay_reads(r)
                    raw.append(time.perf_counter() - t)
            times.sort()
            p50 = times[len(times) // 2]
            p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
            index_mib = sum(p.stat().st_size for p in (root / "index").glob("*")) / 2**20
            points.append({"entries": float(n), "p50": p50, "p99": p99, "build_s": build_s,
                           "index_mib": index_mib, "gets": statistics.median(gets),
                           "raw_gets_p50": statistics.median(raw),
                           "load": os.getloadavg()[0]})
            print(f"  {n} entries: p50 {p50 * 1e6:.0f} µs, p99 {p99 * 1e6:.0f} µs; its "
                  f"{statistics.median(gets):.0f} gets alone {statistics.median(raw) * 1e6:.0f} µs "
                  f"(built in {build_s:.0f} s, index {index_mib:.0f} MiB, "
                  f"load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        builder.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"points": points, "query_tokens": 32768}


def _compact_point(scratch: Path, blocks: int, per_entry: int, reps: int) -> dict[str, float]:
    from fast_root import build_compact_root

    times = []
    deleted = 0
    for _ in range(reps):
        root = Path(tempfile.mkdtemp(prefix="compact-", dir=scratch))
        try:
            t0 = time.perf_counter()
            ids = build_compact_root(root, NS, blocks=blocks, blocks_per_entry=per_entry)
            build_s = time.perf_counter() - t0
            with Store.open(root, namespace=NS, create=False, durable=False) as store:
                victims = ids[:: 10]  # a tenth of the entries, spread over the root
                for e in victims:
                    store.delete(e)
                deleted = len(victims)
                os.sync()
                t = time.perf_counter()
                rep = store.compact(grace=0)
                times.append(time.perf_counter() - t)
                assert rep.freed_bytes > 0
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return {"blocks": float(blocks), "entries": float(blocks // per_entry),
            "deleted_entries": float(deleted), "compact": statistics.median(times),
            "build_s": build_s}


def compact(scratch: Path, reps: int, max_blocks: int) -> dict[str, Any]:
    """Compact time against blocks (16 an entry) and against entries (100k blocks)."""
    by_blocks, by_entries = [], []
    for b in [x for x in BLOCKS if x <= max_blocks]:
        p = _compact_point(scratch, b, 16, reps if b < 1_000_000 else 1)
        by_blocks.append(p)
        print(f"  {b} blocks, {int(p['entries'])} entries: compact {p['compact']:.2f} s "
              f"(built in {p['build_s']:.0f} s)", flush=True)
    if max_blocks >= 100_000:
        for e in ENTRIES_AT_100K:
            p = _compact_point(scratch, 100_000, 100_000 // e, reps)
            by_entries.append(p)
            print(f"  100000 blocks, {e} entries: compact {p['compact']:.2f} s", flush=True)
    return {"by_blocks": by_blocks, "by_entries": by_entries}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("groups", nargs="*", default=["save-restore", "lookup", "compact"],
                    help="save-restore (with verify), lookup, compact; default all")
    ap.add_argument("--json", help="merge the figures into this file")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="up to 4k tokens, 10k entries/blocks")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the scratch roots go")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kvstore-scaling-", dir=args.dir))
    doc: dict[str, Any] = {}
    if args.json and Path(args.json).exists():
        doc = json.loads(Path(args.json).read_text(encoding="utf-8"))
    doc.setdefault("machine", {})
    doc["machine"].update({"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()[0]})
    try:
        for g in args.groups:
            print(f"[{g}] load {os.getloadavg()[0]:.2f}", flush=True)
            t0 = time.perf_counter()
            if g in ("save-restore", "verify"):
                res = save_restore(scratch, args.reps, 4096 if args.quick else TOKENS[-1], True)
                doc["save_restore"] = res
            elif g == "lookup":
                doc["lookup"] = lookup(scratch, args.reps, 10_000 if args.quick else ENTRIES[-1])
            elif g == "compact":
                doc["compact"] = compact(scratch, args.reps, 10_000 if args.quick else BLOCKS[-1])
            else:
                raise SystemExit(f"unknown group {g!r}")
            print(f"  ({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.2f})")
            if args.json:
                Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
