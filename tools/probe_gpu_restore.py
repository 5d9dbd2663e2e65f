"""On a CUDA GPU: is the staged restore bit-exact, and where does its time go?

    python tools/probe_gpu_restore.py [--tokens 32767]

1. For every cache kind (KV in bfloat16 and float32, quantized, rotating, arrays, a list),
   at 16 and 256 tokens a block, verified and not: the staged restore against the same
   restore filled on the host (``KVSTORE_GPU_RESTORE=0``) and against the saved tensors,
   bit for bit; a prefix of a KV entry (a partial last block, zeroed spare rows); a block
   that hashes wrong (restored up to it). Prints ``CHECK PASSED`` or ``CHECK FAILED``.
2. A Llama-3-8B-shaped KV cache (32 layers, 8 heads of 128, bfloat16) of ``--tokens``
   tokens: ``Store.restore`` alone against the pipeline limit on the same block files
   (``kvstore.bench.gpu_limits``), medians of 5 after 2 warm-ups, and the phases of the
   restore: ``mx.load`` allocating the arrays, moving their pages to the card, the staged
   read (read, hash, copy), the final wait.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _cache

import kvstore
from kvstore.bench.common import block_files
from kvstore.bench.gpu_limits import GpuLimits
from kvstore.codecs import staging
from kvstore.local import staged

C: Any = _cache  # untyped
NS = kvstore.Namespace(model_id="probe-gpu", config_fingerprint="c", tokenizer_hash="t")


def _kv(n: int, seed: int, dtype: Any = mx.bfloat16) -> Any:
    c = C.KVCache()
    k = mx.random.normal((1, 2, n, 32), key=mx.random.key(seed)).astype(dtype)
    c.update_and_fetch(k, -k)
    return c


def _mixed(n: int) -> list[Any]:
    q = C.QuantizedKVCache(group_size=32, bits=4)
    k = mx.random.normal((1, 2, n, 32), key=mx.random.key(2)).astype(mx.float16)
    q.update_and_fetch(k, k)
    r = C.RotatingKVCache(max_size=48, keep=0)
    for i in range(n):
        r.update_and_fetch(k[:, :, i : i + 1].astype(mx.bfloat16), k[:, :, i : i + 1])
    a = C.ArraysCache(2)
    a[0] = mx.random.normal((1, 3, 32), key=mx.random.key(4))
    a[1] = mx.random.normal((1, 4, 8, 8), key=mx.random.key(5))
    return [_kv(n, 1), q, r, a, C.CacheList(_kv(n, 6), _kv(n, 7, mx.float32))]


def _arrays(cache: Any) -> list[Any]:
    out: list[Any] = []
    for c in cache:
        if isinstance(c, C.CacheList):
            out += _arrays(list(c.caches))
        elif isinstance(c, C.ArraysCache):
            out += [a for a in c.cache if a is not None]
        elif isinstance(c, C.QuantizedKVCache):
            out += [a[..., : c.offset, :] for a in (*c.keys, *c.values)]
        elif isinstance(c, C.RotatingKVCache):
            rows = min(c.offset, c.keys.shape[2])
            out += [c.keys[..., :rows, :], c.values[..., :rows, :]]
        else:
            out += list(c.keys_and_values())
    return out


def _same(a: mx.array, b: mx.array) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and bool(mx.all(a.view(mx.uint8) == b.view(mx.uint8)).item()))


def _host(fn: Callable[[], tuple[Any, int]]) -> tuple[Any, int]:
    os.environ["KVSTORE_GPU_RESTORE"] = "0"
    try:
        return fn()
    finally:
        del os.environ["KVSTORE_GPU_RESTORE"]


def check(tmp: Path) -> bool:
    ok = True
    for t, n in ((16, 100), (256, 3000)):
        toks = list(range(5, 5 + n))
        with kvstore.Store.open(tmp / f"r{t}", namespace=NS, durable=False,
                                block_tokens=t) as s:
            cache = _mixed(n)
            s.save(toks, cache)
            for verify in (True, False):
                got, n1 = s.restore(toks, verify=verify)
                want, n2 = _host(lambda s=s, v=verify, q=toks: s.restore(q, verify=v))  # type: ignore[misc]
                a, b, ref = _arrays(got), _arrays(want), _arrays(cache)
                eq = n1 == n2 == n and all(_same(x, y) for x, y in zip(a, b, strict=True))
                eq_saved = all(_same(x, y) for x, y in zip(a, ref, strict=True))
                print(f"{t} tokens a block, {n} tokens, verify={verify}: bit-exact against "
                      f"the host path {eq}, against the saved tensors {eq_saved}", flush=True)
                ok &= eq and eq_saved
        with kvstore.Store.open(tmp / f"p{t}", namespace=NS, durable=False,
                                block_tokens=t) as s:
            s.save(toks, [_kv(n, 1), _kv(n, 2, mx.float16)])
            q = toks[: n // 2 + 3] + [1, 1]
            got, n1 = s.restore(q)
            want, n2 = _host(lambda s=s, q=q: s.restore(q))  # type: ignore[misc]
            pe = n1 == n2 == n // 2 + 3 and all(
                _same(g.keys, w.keys) and _same(g.values, w.values)
                for g, w in zip(got or [], want, strict=True))
            print(f"prefix of {n1} tokens, spare rows included: bit-exact {pe}", flush=True)
            ok &= pe
    with kvstore.Store.open(tmp / "bad", namespace=NS, durable=False, block_tokens=16) as s:
        toks = list(range(5, 105))
        info = s.save(toks, [_kv(100, 1)])
        p = Path(s.local.blocks.where(s.manifest(info.id).token_blocks[3]))
        data = bytearray(p.read_bytes())
        data[9] ^= 1
        os.chmod(p, 0o644)
        p.write_bytes(bytes(data))
        _, n1 = s.restore(toks)
        print(f"block 3 of 7 hashing wrong: {n1} tokens restored (48 wanted)", flush=True)
        ok &= n1 == 48
    print("CHECK", "PASSED" if ok else "FAILED", flush=True)
    return ok


def phases(tmp: Path, n: int) -> None:
    acc: dict[str, list[float]] = defaultdict(list)

    def wrap(obj: Any, name: str, key: str) -> None:
        f = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[key].append(time.perf_counter() - t)

        setattr(obj, name, timed)

    wrap(staging.CudaCopier, "prepare", "moving the pages to the card")
    wrap(staging.CudaCopier, "finish", "the final wait")
    wrap(staged, "run_jobs", "the staged read (read, hash, copy)")
    wrap(staged.StagedStream, "finish", "all of the staged read's finish")
    wrap(mx, "load", "mx.load (the arrays allocated)")
    cache = []
    for i in range(32):
        c = C.KVCache()
        k = mx.random.normal((1, 8, n, 128), key=mx.random.key(i)).astype(mx.bfloat16)
        c.update_and_fetch(k, k * 2)
        mx.eval(c.keys, c.values)
        cache.append(c)
    toks = list(range(n))
    with kvstore.Store.open(tmp / "big", namespace=NS) as s:
        s.save(toks, cache)
    del cache
    target = staging.cuda_device()
    assert target is not None
    lim = GpuLimits(target[0], target[1], block_files(tmp / "big"))
    s = kvstore.Store.open(tmp / "big", namespace=NS, create=False)
    total: list[float] = []
    pipe: list[float] = []
    for i in range(7):
        mx.synchronize()
        t = time.perf_counter()
        restored, m = s.restore(toks)
        mx.synchronize()
        dt = time.perf_counter() - t
        assert m == n
        del restored
        p = lim.pipeline()
        if i < 2:
            for v in acc.values():
                v.clear()
            continue
        total.append(dt)
        pipe.append(p)
    print(f"Store.restore alone {statistics.median(total) * 1e3:.1f} ms, the pipeline limit "
          f"{statistics.median(pipe) * 1e3:.1f} ms")
    for name, v in acc.items():
        print(f"  {name:40s} {statistics.median(v) * 1e3:8.1f} ms")
    s.close()
    lim.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32767)
    args = ap.parse_args()
    if staging.cuda_device() is None:
        raise SystemExit("MLX has no CUDA GPU here")
    tmp = Path(tempfile.mkdtemp(prefix="probe-gpu-"))
    try:
        check(tmp)
        phases(tmp, args.tokens)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
