"""Time to first token on a GPU (issue 37): prefill vs kvstore's restore vs mlx-lm's file.

Where MLX has a GPU (the ``mlx-cuda-13`` wheel on an NVIDIA card, or Metal), a
Llama-3-8B-shaped model (32 layers, hidden 4096, 32 heads, 8 KV heads of 128, MLP
14336, vocabulary 128256; random bfloat16 weights) answers an ``n``-token prompt three
ways, each ending with the first token (the forward step of the prompt's last token
and its argmax, evaluated):

- **prefill**: the first ``n - 1`` tokens in chunks of 2048 (mlx-lm's
  ``prefill_step_size``) from an empty cache;
- **kvstore**: ``Store.restore`` (verified, the default) of the first ``n - 1`` tokens;
- **mlx-lm**: ``load_prompt_cache`` of the same cache saved with ``save_prompt_cache``.

The restores run with the files in the page cache (``warm``) and after
``POSIX_FADV_DONTNEED`` on every block file and on the safetensors file
(``dropped``); each row's ``read_gbps`` is a plain read of the safetensors file right
after the drop, so a machine whose page cache ignores the advice (a sandboxed kernel)
shows it. The first token of every restore must equal the prefill's. Without a GPU
the group is skipped with one line saying so.

On a CUDA GPU (where restores go through pinned staging onto the card,
:mod:`kvstore.local.staged`) each size also has, on the same block files: the same restore
with the arrays filled on the host (``KVSTORE_GPU_RESTORE=0``: managed memory the card
pulls across on first use), in rounds of its own; and the machine's limit rows of
:mod:`kvstore.bench.gpu_limits` (the reads, the copies, and their pipeline, which every
restore row is read against).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .common import Config, Row, block_files, drop_from_page_cache, median, read_all
from .limits import limit_row

if TYPE_CHECKING:
    from .gpu_limits import GpuLimits

PREFILL_STEP = 2048


@dataclass(frozen=True)
class Shape:
    """A llama model's shape (``mlx_lm.models.llama.ModelArgs``)."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


LLAMA3_8B = Shape("Llama-3-8B shape", 4096, 32, 14336, 32, 8, 128, 128256)
TINY = Shape("tiny llama shape", 128, 2, 256, 4, 2, 32, 512)  # for trying the case on a CPU


def gpu_reason() -> str | None:
    """Why this process cannot run the group; None when MLX has a GPU."""
    try:
        ok = bool(mx.is_available(mx.gpu))
    except (AttributeError, RuntimeError, ValueError) as e:
        return f"MLX cannot tell whether it has a GPU ({e})"
    if not ok:
        version = getattr(mx, "__version__", "?")
        return (f"MLX {version} has no GPU here (its device is {mx.default_device()}; "
                "on an NVIDIA card install the mlx-cuda-13 wheel)")
    return None


def make_model(shape: Shape, dtype: Any = mx.bfloat16) -> Any:
    """A llama model of ``shape`` with random weights in ``dtype``, evaluated layer by layer."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        intermediate_size=shape.intermediate, num_attention_heads=shape.heads,
        rms_norm_eps=1e-5, vocab_size=shape.vocab, head_dim=shape.head_dim,
        num_key_value_heads=shape.kv_heads, rope_theta=500000.0, tie_word_embeddings=False)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(dtype)
    for layer in model.model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def _first_token(model: Any, cache: list[Any], last: int) -> int:
    logits = model(mx.array([[last]]), cache=cache)
    tok = mx.argmax(logits[0, -1])
    mx.eval(tok)
    return int(tok.item())  # type: ignore[arg-type]


def _prefill(model: Any, tokens: list[int]) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for i in range(0, len(tokens), PREFILL_STEP):
        model(mx.array([tokens[i : i + PREFILL_STEP]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def _sync() -> None:
    mx.synchronize()


def gpu_rows(cfg: Config, scratch: Path, log: Callable[[str], None] = print, *,
             shape: Shape = LLAMA3_8B, force: bool = False) -> list[Row]:
    """The group's rows for each of ``cfg.gpu_sizes`` (``force``: run without a GPU too,
    on whatever device MLX has: a check of the case, not a figure)."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from ..schema import Namespace
    from ..store import Store

    why = gpu_reason()
    if why is not None and not force:
        log(f"[gpu] skipped: {why}")
        return []
    device = _device_name()
    log(f"[gpu] {shape.name} on {device}, {', '.join(map(str, cfg.gpu_sizes))} tokens")
    t = time.perf_counter()
    model = make_model(shape)
    log(f"  model built in {time.perf_counter() - t:.1f} s")
    rng = mx.random.randint(0, shape.vocab, (max(cfg.gpu_sizes),), key=mx.random.key(1))
    all_tokens: list[int] = [int(x) for x in rng.tolist()]  # type: ignore[arg-type,union-attr]
    # warm-up: the kernels' first use (compilation) is not part of any side
    warm_cache = _prefill(model, all_tokens[:PREFILL_STEP + 17])
    _first_token(model, warm_cache, all_tokens[0])
    del warm_cache
    ns = Namespace(model_id=f"kvstore-bench-{shape.name}", config_fingerprint="random")
    rows: list[Row] = []
    for n in cfg.gpu_sizes:
        tokens = all_tokens[:n]
        head, last = tokens[:-1], tokens[-1]
        lab = f"{n // 1024}k" if n % 1024 == 0 else str(n)
        prefill_s: list[float] = []
        want = None
        for _ in range(max(1, cfg.gpu_reps - 1)):
            _sync()
            t = time.perf_counter()
            cache = _prefill(model, head)
            tok = _first_token(model, cache, last)
            prefill_s.append(time.perf_counter() - t)
            want = tok if want is None else want
        for c in cache:  # back to the first n - 1 tokens: what is stored
            c.trim(1)
        root = Path(tempfile.mkdtemp(prefix=f"gpu-{n}-", dir=scratch))
        file = root.parent / f"{root.name}.safetensors"
        try:
            with Store.open(root, namespace=ns) as store:
                store.save(head, cache)
            save_prompt_cache(str(file), cache)
            nbytes = sum(c.nbytes for c in cache)
            del cache
            files = [*block_files(root), file]
            store = Store.open(root, namespace=ns, create=False)

            alone: list[float] = []  # the Store.restore share of the side just run

            def kv(store: Store = store, head: list[int] = head, last: int = last,
                   host: bool = False, alone: list[float] = alone) -> tuple[float, int]:
                """Restore + first token (``host``: the arrays filled on the host, as before
                the staged restore); the restore's own share goes to ``alone``."""
                _sync()
                if host:
                    os.environ["KVSTORE_GPU_RESTORE"] = "0"
                try:
                    t = time.perf_counter()
                    c, length = store.restore(head)
                    _sync()
                    alone.append(time.perf_counter() - t)
                finally:
                    if host:
                        del os.environ["KVSTORE_GPU_RESTORE"]
                assert c is not None and length == len(head)
                tok = _first_token(model, c, last)
                return time.perf_counter() - t, tok

            def ml(file: Path = file, last: int = last) -> tuple[float, int]:
                _sync()
                t = time.perf_counter()
                c = load_prompt_cache(str(file))  # type: ignore[no-untyped-call]
                tok = _first_token(model, c, last)
                return time.perf_counter() - t, tok

            lim = _limits(root)
            for where in ("warm", "dropped"):
                if where == "dropped":
                    try:
                        drop_from_page_cache(files)
                    except OSError as e:  # a kernel without fadvise: the warm rows only
                        log(f"  {lab}: the page cache cannot be dropped here ({e})")
                        continue
                res: dict[str, list[float]] = {}
                alones: dict[str, list[float]] = {}
                read_gbps: list[float] = []
                read_all(files)
                sides: list[tuple[str, Callable[[], tuple[float, int]]]] = [
                    ("kv", kv), ("ml", ml)]
                if lim is not None:
                    sides += [("pipe", _timed_only(lim.pipeline, want))]
                    if where == "dropped":
                        sides += [("read", _timed_only(lim.read, want))]
                for rnd in range(cfg.gpu_reps + 1):
                    for side, fn in sides if rnd % 2 else sides[::-1]:
                        if where == "dropped":
                            drop_from_page_cache(files)
                        alone.clear()
                        dt, tok = fn()
                        if tok != want:
                            raise AssertionError(f"{side} restore at {n} tokens gave token "
                                                 f"{tok}, the prefill {want}")
                        if rnd:
                            res.setdefault(side, []).append(dt)
                            alones.setdefault(side, []).extend(alone)
                if where == "warm" and lim is not None:  # rounds of their own: the host
                    # path's pages end on the host, and MLX hands freed buffers on
                    host_sides: list[tuple[str, Callable[[], tuple[float, int]]]] = [
                        ("kv_host", functools.partial(kv, host=True)), ("kv", kv)]
                    for rnd in range(cfg.gpu_reps + 1):
                        for side, fn in host_sides if rnd % 2 else host_sides[::-1]:
                            alone.clear()
                            dt, tok = fn()
                            if tok != want:
                                raise AssertionError(f"{side} restore at {n} tokens gave "
                                                     f"token {tok}, the prefill {want}")
                            if rnd:
                                res.setdefault(side + "_ab", []).append(dt)
                                alones.setdefault(side + "_ab", []).extend(alone)
                if where == "dropped":
                    drop_from_page_cache([file])
                    t = time.perf_counter()
                    read_all([file])
                    read_gbps.append(file.stat().st_size / (time.perf_counter() - t) / 1e9)
                extra = {"tokens": float(n), "gb": nbytes / 1e9, "prefill_s": median(prefill_s),
                         "restore_alone_s": median(alones["kv"])}
                if read_gbps:
                    extra["read_gbps"] = read_gbps[0]
                what = "page cache" if where == "warm" else "after eviction"
                name = f"GPU time to first token, {lab} tokens, {what} ({shape.name}, {device})"
                kv_s = median(res["kv"])
                new = [
                    Row("gpu", f"{name}: kvstore restore vs prefill", "s", kv_s,
                        median(prefill_s), "prefill from scratch", "speedup",
                        # from the page cache: faster than the prefill, 3x from 32k on; after
                        # eviction the disk's own speed is the goal (the limit rows)
                        extra={**extra, **({"target": 3.0 if n >= 32768 else 1.0}
                                           if where == "warm" else {})}),
                    Row("gpu", f"{name}: kvstore restore vs mlx-lm load_prompt_cache", "s",
                        kv_s, median(res["ml"]), "mlx-lm load_prompt_cache", "speedup",
                        extra=extra),
                ]
                if "kv_host_ab" in res:
                    new.append(Row(
                        "gpu", f"{name}: kvstore restore vs the same restore filled on the host",
                        "s", median(res["kv_ab"]), median(res["kv_host_ab"]),
                        "Store.restore into managed memory, the card pulling its pages on first "
                        "use (KVSTORE_GPU_RESTORE=0)", "speedup",
                        extra={**extra, "host_alone_s": median(alones["kv_host_ab"]),
                               "staged_alone_s": median(alones["kv_ab"])}))
                if lim is not None:
                    new += _limit_rows(lab, what, lim, res, alones, where, cfg.gpu_reps)
                rows += new
                for r in new:
                    log(f"  {r.name}: kvstore {r.kvstore * 1e3:.1f} ms, baseline "
                        f"{r.baseline * 1e3:.1f} ms, ratio {r.ratio:.2f}")
            if lim is not None:
                lim.close()
            store.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
            file.unlink(missing_ok=True)
    return rows


def _device_name() -> str:
    try:
        info = mx.device_info()
        name = info.get("device_name") or info.get("architecture")
        if name:
            return str(name)
    except (AttributeError, RuntimeError):
        pass
    return str(mx.default_device())


def _limits(root: Path) -> GpuLimits | None:
    """The machine's limit rows on ``root``'s block files, where restores go to a CUDA GPU."""
    from ..codecs.staging import cuda_device

    target = cuda_device()
    if target is None:
        return None
    from .gpu_limits import GpuLimits

    return GpuLimits(target[0], target[1], block_files(root))


def _timed_only(fn: Callable[[], float], tok: int | None) -> Callable[[], tuple[float, int]]:
    """A limit side in the restore rounds: its seconds, and the prefill's token (it has none)."""
    return lambda: (fn(), tok if tok is not None else -1)


def _limit_rows(lab: str, what: str, lim: GpuLimits, res: dict[str, list[float]],
                alones: dict[str, list[float]], where: str, reps: int) -> list[Row]:
    """The restore against the machine's limits on the same bytes (``gpu_limits``)."""
    th = f"{lim.threads} threads"
    kv_alone = median(alones["kv"])
    kv_total = median(res["kv"])
    base = f"limit: GPU restore {lab} {what}"
    pipe = median(res["pipe"])
    if where == "dropped":
        return [
            limit_row(f"{base}: Store.restore alone", kv_alone, median(res["read"]),
                      f"the disk's own read of its block files (cold), {th}", target=0.8,
                      ),
            limit_row(f"{base}: Store.restore alone, vs the pipeline", kv_alone, pipe,
                      f"cold read + BLAKE3 + copy to the card, pipelined, {th}", target=None),
        ]
    parts: dict[str, Callable[[], float]] = {
        "read": lambda: lim.read(hash=False),
        "read_hash": lambda: lim.read(hash=True),
        "h2d": lambda: lim.h2d(pinned=True),
        "h2d_pageable": lambda: lim.h2d(pinned=False),
    }
    got: dict[str, list[float]] = {k: [] for k in parts}
    for rnd in range(reps + 1):
        for k, fn in parts.items():
            dt = fn()
            if rnd:
                got[k].append(dt)
    gb = lim.total / 1e9
    labels = {
        "read": f"read of its block files into pinned memory, {th}",
        "read_hash": f"the same read + BLAKE3 of every block, {th}",
        "h2d": "one host-to-device copy of those bytes from pinned memory",
        "h2d_pageable": "the same copy from pageable memory",
    }
    rows = [limit_row(f"{base}: Store.restore alone, vs {k}", kv_alone, median(v), labels[k],
                      target=None, extra={"gbps": gb / median(v)})
            for k, v in got.items()]
    rows += [
        limit_row(f"{base}: Store.restore alone", kv_alone, pipe,
                  f"read + BLAKE3 + copy to the card, pipelined, {th}", target=0.5,
                  extra={"gbps": gb / pipe}),
        limit_row(f"{base}: restore + first token", kv_total, pipe,
                  f"read + BLAKE3 + copy to the card, pipelined, {th}", target=None),
    ]
    return rows
