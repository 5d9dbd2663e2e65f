"""Disk cases: save, restore, multi-turn, shared system prompt — kvstore vs mlx-lm's file."""

from __future__ import annotations

import functools
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

from ..blocks import hash_bytes
from ..blocks.pools import io_pool
from ..catalog.settings import DEFAULT_BLOCK_TOKENS, DEFAULT_STATE_BLOCK
from ..codecs import snapshot, warm
from ..local import LocalBlockStore
from ..local.writer import place
from ..schema import Namespace
from ..store import Store
from .common import (
    Config,
    Row,
    block_files,
    cache_bytes,
    decode_step,
    disk_usage,
    drop_from_page_cache,
    fsync_path,
    grow,
    interleave,
    make_cache,
    median,
    read_all,
    settle,
)
from .limits import limit_row, raw_durable_write

NS = Namespace(model_id="kvstore-bench", config_fingerprint="synthetic")
MLX = "mlx-lm save_prompt_cache"
MLX_LOAD = "mlx-lm load_prompt_cache"

# mlx-lm's cache module is untyped: typed handles for what the cases use
KVCache: Any = _mlx_cache.KVCache
save_prompt_cache: Any = _mlx_cache.save_prompt_cache
load_prompt_cache: Any = _mlx_cache.load_prompt_cache



def tokens_for(n: int, *, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def _label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _mlx_save(path: Path, cache: list[Any], durable: bool) -> None:
    save_prompt_cache(str(path), cache)
    if durable:
        fsync_path(path)


def _save_parts(scratch: Path, n: int, cache: list[Any]) -> tuple[Callable[[], float], ...]:
    """The two halves of a non-durable save's work, each timed alone on the I/O threads.

    Hashing every block, and writing every block to a new file without
    hashing: what the save does on two cores, where save_prompt_cache only
    writes, on one. Reported beside the save so its ratio can be read
    against the bound they set.
    """
    _, bs = place([snapshot(c) for c in cache], n, DEFAULT_BLOCK_TOKENS, DEFAULT_STATE_BLOCK)
    blocks = bs.token_pieces + bs.state_pieces
    pool = io_pool()

    def hashing() -> float:
        t = _clock()
        list(pool.map(lambda pieces: hash_bytes("blake3", *pieces), blocks))
        return _clock() - t

    def writing() -> float:
        root = Path(tempfile.mkdtemp(prefix="write-", dir=scratch))
        (root / "tmp").mkdir()
        bstore = LocalBlockStore(root, "blake3", durable=False)
        try:
            t = _clock()
            list(pool.map(bstore.stage, blocks))
            return _clock() - t
        finally:
            shutil.rmtree(root)

    return hashing, writing


def save_rows(cfg: Config, scratch: Path, n: int, cache: list[Any]) -> list[Row]:
    """Save into a fresh root each rep (no dedup), durable and not, vs one safetensors file."""
    toks = tokens_for(n, seed=n)
    nbytes = cache_bytes(cache)
    hashing, writing = _save_parts(scratch, n, cache)
    _, placed = place([snapshot(c) for c in cache], n, DEFAULT_BLOCK_TOKENS, DEFAULT_STATE_BLOCK)
    raw_blocks = placed.token_pieces + placed.state_pieces
    parallel = io_pool()._max_workers

    def kv(durable: bool) -> float:
        root = Path(tempfile.mkdtemp(prefix="save-", dir=scratch))
        store = Store.open(root, namespace=NS, durable=durable)
        try:
            t = _clock()
            store.save(toks, cache)
            return _clock() - t
        finally:
            store.close()
            shutil.rmtree(root)

    def ml(durable: bool) -> float:
        path = scratch / "save.safetensors"
        try:
            t = _clock()
            _mlx_save(path, cache, durable)
            return _clock() - t
        finally:
            path.unlink(missing_ok=True)

    res = interleave(
        {
            "kv_d": lambda: kv(True),
            "ml_d": lambda: ml(True),
            "kv_n": lambda: kv(False),
            "ml_n": lambda: ml(False),
            "hash": hashing,
            "write": writing,
            "raw_d": lambda: raw_durable_write(scratch, raw_blocks, parallel),
        },
        cfg.reps,
        before=settle,
    )
    gb = nbytes / 1e9
    lab = _label(n)
    return [
        Row("save", f"save {lab} durable", "s", median(res["kv_d"]), median(res["ml_d"]),
            MLX + " + fsync", "speedup", extra={"gb": gb}),
        Row("save", f"save {lab} non-durable", "s", median(res["kv_n"]), median(res["ml_n"]),
            MLX, "speedup", extra={"gb": gb}),
        # not saves: the two halves of a non-durable save's work, for reading its ratio
        Row("save", f"part of the {lab} non-durable save: BLAKE3 of every block, alone", "s",
            median(res["hash"]), median(res["ml_n"]), MLX, "speedup", extra={"gb": gb}),
        Row("save", f"part of the {lab} non-durable save: writing every block, alone", "s",
            median(res["write"]), median(res["ml_n"]), MLX, "speedup", extra={"gb": gb}),
        # the machine's own limits on the same bytes (issue 16)
        limit_row(f"limit: save {lab} durable", median(res["kv_d"]), median(res["raw_d"]),
                  f"its blocks written to as many files + one fsync round, {parallel} threads"),
        limit_row(f"limit: save {lab} non-durable", median(res["kv_n"]),
                  max(median(res["hash"]), median(res["write"])),
                  "max(hashing alone, writing alone): perfect overlap"),
        limit_row(f"limit: save {lab} non-durable, halves in sequence", median(res["kv_n"]),
                  median(res["hash"]) + median(res["write"]),
                  "hashing alone + writing alone: no overlap (each half already uses every core)",
                  target=None),
    ]


def _clock() -> float:
    import time

    return time.perf_counter()


class SavedPair:
    """One cache saved both ways: a kvstore root and a safetensors file, both synced."""

    def __init__(self, scratch: Path, n: int, cache: list[Any]) -> None:
        self.n = n
        self.tokens = tokens_for(n, seed=n)
        self.root = Path(tempfile.mkdtemp(prefix=f"restore-{n}-", dir=scratch))
        with Store.open(self.root, namespace=NS) as store:
            store.save(self.tokens, cache)
        self.file = self.root.parent / f"{self.root.name}.safetensors"
        _mlx_save(self.file, cache, True)
        self.bytes = cache_bytes(cache)
        self.store = Store.open(self.root, namespace=NS, create=False)

    def kv_restore(self, *, verify: bool = False, parts: list[float] | None = None) -> float:
        """Seconds to a cache ready to decode; ``parts`` gets the ``Store.restore`` call's
        share of them (the limit rows compare that share with the machine's reads)."""
        t = _clock()
        cache, length = self.store.restore(self.tokens, verify=verify)
        restored = _clock()
        assert cache is not None and length == self.n, "the benchmark entry went missing"
        decode_step(cache)
        done = _clock()
        if parts is not None:
            parts.append(restored - t)
        return done - t

    def mlx_restore(self) -> float:
        # mlx-lm as it runs in a process of its own: MLX's default cache limit, and none of
        # the memory kvstore keeps warm for its restores (issue 37) left for it to reuse
        warm.POLICY.give_back()
        t = _clock()
        cache = load_prompt_cache(str(self.file))
        mx.eval([c.state for c in cache])
        decode_step(cache)
        dt = _clock() - t
        del cache
        self.rewarm()
        return dt

    def rewarm(self) -> None:
        """One untimed restore, so that the kvstore side timed next finds the warm memory
        every other kvstore side of the rounds finds. Without it the side that follows
        mlx-lm's in the reversed rounds (``verify_reads=False``, always) faulted in fresh
        pages there and nowhere else: 15,000 faults against 35, and its median came out
        slower than the verified restore's (143 against 102 ms)."""
        cache, _ = self.store.restore(self.tokens, verify=False)
        del cache

    def warm(self) -> None:
        read_all([*block_files(self.root), self.file])

    def drop(self) -> None:
        drop_from_page_cache([*block_files(self.root), self.file])

    def remove(self) -> None:
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)
        self.file.unlink(missing_ok=True)


def restore_rows(cfg: Config, pair: SavedPair) -> list[Row]:
    """Restore to ready-to-decode, verified (the default) and with verification off, from
    the page cache and after eviction, each interleaved with ``load_prompt_cache``; and,
    from the same runs, the limit rows: the ``Store.restore`` share of each (the decode
    step left out) against ``preadv`` of its block files in the same rounds (one case,
    one measurement: the limit rows never time a restore of their own)."""
    from .limits import RawRead, restore_limit_rows

    lab = _label(pair.n)
    gb = pair.bytes / 1e9
    raw = RawRead(pair.root)
    rows = []
    for where in ("page cache", "after eviction"):
        parts: dict[str, list[float]] = {"kv": [], "kv_raw": []}
        sides: dict[str, Callable[[], float]] = {
            "kv": functools.partial(pair.kv_restore, verify=True, parts=parts["kv"]),
            "kv_raw": functools.partial(pair.kv_restore, verify=False, parts=parts["kv_raw"]),
            "ml": pair.mlx_restore, "raw": raw}
        if where == "page cache":
            sides["raw_v"] = lambda: raw(hash=True)
        pair.warm()
        res = interleave(sides, cfg.reps, before=pair.drop if where != "page cache" else None)
        names = {"kv": f"restore {lab} {where}", "kv_raw": f"restore {lab} {where}, "
                 "verify_reads=False"}
        rows += [
            Row("restore", names["kv"], "s", median(res["kv"]),
                median(res["ml"]), MLX_LOAD + " (no verification)", "speedup",
                extra={"gb": gb, "verified": True}),
            Row("restore", names["kv_raw"], "s",
                median(res["kv_raw"]), median(res["ml"]), MLX_LOAD, "speedup",
                extra={"gb": gb, "verified": False}),
        ]
        # interleave runs each side once to warm up first: that run is not a sample
        shares = {k: v[1:] for k, v in parts.items()}
        rows += restore_limit_rows(names, shares, res, raw.threads,
                                   verified=where == "page cache")
    # issue 37: the same restore repeated in one process, and in a fresh one
    from .warm_cases import warm_rows

    rows += warm_rows(lab, pair, raw, cfg.reps)
    pair.warm()
    return rows


def multiturn_rows(cfg: Config, scratch: Path) -> list[Row]:
    """A conversation growing by ``turn_tokens`` a turn: kvstore vs re-saving the whole file.

    kvstore is measured twice on roots of their own: a plain save (every block
    hashed; existing ones not written) and ``save(reuse_prefix=True)``, which
    references the previous turn's full blocks instead of rehashing them.
    """
    cache = [KVCache() for _ in range(cfg.layers)]
    toks = tokens_for(cfg.turns * cfg.turn_tokens, seed=99)
    root = Path(tempfile.mkdtemp(prefix="turns-", dir=scratch))
    root_reuse = Path(tempfile.mkdtemp(prefix="turns-reuse-", dir=scratch))
    path = scratch / "turns.safetensors"
    kv_t = ml_t = re_t = 0.0
    kv_bytes = ml_bytes = re_bytes = 0
    try:
        with Store.open(root, namespace=NS) as store, Store.open(
            root_reuse, namespace=NS
        ) as reuse_store:
            for turn in range(cfg.turns):
                grow(cache, cfg, cfg.turn_tokens, seed=1000 + turn)
                n = (turn + 1) * cfg.turn_tokens

                def kv(n: int = n) -> float:
                    nonlocal kv_bytes
                    t = _clock()
                    info = store.save(toks[:n], cache)
                    dt = _clock() - t
                    kv_bytes += info.new_bytes
                    return dt

                def kv_reuse(n: int = n) -> float:
                    nonlocal re_bytes
                    t = _clock()
                    info = reuse_store.save(toks[:n], cache, reuse_prefix=True)
                    dt = _clock() - t
                    re_bytes += info.new_bytes
                    return dt

                def ml() -> float:
                    nonlocal ml_bytes
                    t = _clock()
                    _mlx_save(path, cache, True)
                    dt = _clock() - t
                    ml_bytes += path.stat().st_size
                    return dt

                settle()
                order = (kv, kv_reuse, ml) if turn % 2 else (ml, kv_reuse, kv)
                for i, fn in enumerate(order):
                    if i:
                        settle()
                    dt = fn()
                    if fn is kv:
                        kv_t += dt
                    elif fn is kv_reuse:
                        re_t += dt
                    else:
                        ml_t += dt
        unique = cache_bytes(cache)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(root_reuse, ignore_errors=True)
        path.unlink(missing_ok=True)
    label = f"{cfg.turns} turns x {cfg.turn_tokens} tokens"
    size = {"turns": float(cfg.turns), "turn_tokens": float(cfg.turn_tokens)}
    return [
        Row("multiturn", f"multi-turn total save time ({label})", "s", kv_t, ml_t,
            MLX + " + fsync of the whole cache each turn", "speedup", extra=size),
        Row("multiturn", f"multi-turn total save time, reuse_prefix=True ({label})", "s", re_t,
            ml_t, MLX + " + fsync of the whole cache each turn", "speedup", extra=size),
        Row("multiturn", "multi-turn bytes written, reuse_prefix=True", "B", re_bytes, ml_bytes,
            MLX + " of the whole cache each turn", "fraction", extra=size),
        Row("multiturn", "multi-turn bytes written", "B", kv_bytes, ml_bytes,
            MLX + " of the whole cache each turn", "fraction", extra=size),
        Row("multiturn", "multi-turn bytes written vs unique KV bytes", "B", kv_bytes, unique,
            "unique KV bytes of the final cache", "fraction", extra=size),
    ]


def shared_rows(cfg: Config, scratch: Path) -> list[Row]:
    """Many sessions sharing a system prompt: bytes on disk, kvstore vs a file per session."""
    sys_toks = tokens_for(cfg.system_tokens, seed=7)
    sys_cache = make_cache(cfg, cfg.system_tokens, seed=7)
    sys_kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in sys_cache]
    root = Path(tempfile.mkdtemp(prefix="shared-", dir=scratch))
    path = scratch / "session.safetensors"
    file_bytes = 0
    try:
        with Store.open(root, namespace=NS, durable=False) as store:
            for s in range(cfg.sessions):
                cache = [KVCache() for _ in range(cfg.layers)]
                for c, (k, v) in zip(cache, sys_kv, strict=True):
                    c.update_and_fetch(k, v)
                grow(cache, cfg, cfg.session_tokens, seed=5000 + s)
                toks = sys_toks + tokens_for(cfg.session_tokens, seed=5000 + s)
                store.save(toks, cache, priority="user")
                save_prompt_cache(str(path), cache)
                file_bytes += os.stat(path).st_blocks * 512
                path.unlink()
        os.sync()
        kv_bytes = disk_usage(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        path.unlink(missing_ok=True)
    label = f"{cfg.sessions} sessions, {cfg.system_tokens}+{cfg.session_tokens} tokens"
    return [Row("shared", f"shared system prompt: bytes on disk ({label})", "B", kv_bytes,
                file_bytes, "one " + MLX + " file per session", "fraction")]
