"""Where restoring a prefix stops paying (issue 37): restore vs prefill of k tokens.

    python tools/probe_crossover.py [--reps 5] [--json FILE]

For each model and each prefix length k: ``Store.restore`` (verified, the default) of
an entry of k tokens, from the page cache (``warm``) and after ``POSIX_FADV_DONTNEED`` on
its block files (``cold``), against the prefill of the same k tokens from an empty
cache (one forward pass, evaluated). Both end with the state of k tokens; the first
decode step after it costs the same on both sides and is left out. Sides alternate,
medians of ``--reps`` after one warm-up. The models (random weights, float32, as MLX's
bfloat16 matmuls are emulated on a CPU):

- ``tiny``: ``kvstore.tiny`` llama, hidden 64, 2 layers (the bench's TTFT model);
- ``smollm2-shape``: SmolLM2-135M's shape, 30 layers, hidden 576, 3 KV heads of 64.

The crossover is the smallest k at which the restore is faster.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvstore import Namespace, Store
from kvstore.bench.common import block_files, drop_from_page_cache, read_all
from kvstore.bench.gpu_cases import Shape, make_model

MODELS = {
    "tiny": (Shape("tiny llama, hidden 64, 2 layers", 64, 2, 128, 4, 2, 16, 768),
             (4, 8, 16, 32, 64, 128, 256, 1024, 4096)),
    "smollm2-shape": (Shape("SmolLM2-135M shape", 576, 30, 1536, 9, 3, 64, 49152),
                      (4, 8, 16, 32, 64)),
}


def _prefill(model: Any, tokens: list[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    out: list[dict[str, Any]] = []
    for name in a.models.split(","):
        shape, sizes = MODELS[name]
        model = make_model(shape, mx.float32)
        tmp = Path(tempfile.mkdtemp(prefix="crossover-"))
        ns = Namespace(model_id=f"crossover-{name}")
        try:
            with Store.open(tmp / "root", namespace=ns, durable=False) as store:
                for k in sizes:
                    toks = [(7 * i + k) % shape.vocab for i in range(k)]
                    store.save(toks, _prefill(model, toks))
                    files = block_files(tmp / "root")
                    sides = {
                        "prefill": lambda toks=toks, model=model: _prefill(model, toks),
                        "warm": lambda toks=toks: store.restore(toks),
                        "cold": lambda toks=toks: store.restore(toks),
                    }
                    res: dict[str, list[float]] = {s: [] for s in sides}
                    for rnd in range(a.reps + 1):
                        order = list(sides.items())
                        for side, fn in order if rnd % 2 else order[::-1]:
                            if side == "cold":
                                drop_from_page_cache(files)
                            elif side == "warm":
                                read_all(files)
                            t = time.perf_counter()
                            fn()
                            if rnd:
                                res[side].append(time.perf_counter() - t)
                    med = {s: statistics.median(v) for s, v in res.items()}
                    row = {"model": name, "tokens": k, **{f"{s}_ms": v * 1e3
                                                          for s, v in med.items()}}
                    out.append(row)
                    print(f"{name:14} k={k:5}  prefill {med['prefill'] * 1e3:8.2f} ms  "
                          f"restore warm {med['warm'] * 1e3:7.2f} ms  cold "
                          f"{med['cold'] * 1e3:7.2f} ms", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
