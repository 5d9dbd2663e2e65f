"""Would a streamed restore (layers ready one after another) shorten time to first token?

    python tools/stream_restore_ttft.py [--tokens 16384] [--layers 2] [--reps 9]

The experiment behind issue 16's "restore in the background of prefill". It
uses kvstore's public API only. ``kvstore.tiny``'s llama (hidden 64, float32,
``--layers`` layers, 2 by default) fills a cache of ``tokens - 1`` tokens; the
first token after the prompt is then timed three ways, interleaved:

- ``whole``: ``store.restore`` of the whole cache, then the one-token forward
  (what ``kvstore bench``'s TTFT row does);
- ``streamed``: a prototype of ``restore(stream=True)``. Every layer's cache is
  also saved as an entry of its own (its own namespace), a thread restores them
  in layer order, and the caller runs layer i of the forward as soon as layer
  i's restore is done: the first layers compute while later ones are read;
- ``per-layer``: the same per-layer restores one after another, then the
  forward: what the prototype costs without the overlap.

It also times the restore alone and the forward alone, which bound any gain:
at most the forward's time minus its last layer's share. The first token must
match on every side.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from kvstore import Namespace, Store
from kvstore.tiny import make_tiny_model


def _prefill(model: Any, tokens: list[int], step: int = 2048) -> list[Any]:
    cache = make_prompt_cache(model)
    arr = mx.array(tokens)[None]
    for pos in range(0, len(tokens), step):
        model(arr[:, pos : pos + step], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def _forward_layers(model: Any, last: int, caches: list[Any], ready: list[threading.Event] | None,
                    ) -> mx.array:
    """The one-token forward, layer by layer; waits for layer i's cache when ``ready``."""
    inner = model.model
    h = inner.embed_tokens(mx.array([[last]]))
    for i, layer in enumerate(inner.layers):
        if ready is not None:
            ready[i].wait()
        h = layer(h, None, cache=caches[i])  # one query token: no mask
        mx.eval(h)  # compute this layer now, while the next one is being read
    out = inner.norm(h)
    logits = inner.embed_tokens.as_linear(out) if model.args.tie_word_embeddings \
        else model.lm_head(out)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stream-ttft-", dir=args.dir))
    try:
        path = make_tiny_model(work / "tiny", kind="llama", num_layers=args.layers)
        model = load(str(path))[0]
        n_layers = len(model.model.layers)
        rng = np.random.default_rng(args.tokens)
        tokens = [int(t) for t in rng.integers(4, int(model.args.vocab_size), args.tokens)]
        prompt, last = tokens[:-1], tokens[-1]
        t = time.perf_counter()
        cache = _prefill(model, prompt)
        print(f"prefill of {len(prompt)} tokens: {time.perf_counter() - t:.1f} s")
        whole_ns = Namespace(model_id="tiny-llama-whole")
        layer_ns = [Namespace(model_id=f"tiny-llama-layer-{i}") for i in range(n_layers)]
        store = Store.open(work / "root", namespace=whole_ns)
        store.save(prompt, cache)
        for i, ns in enumerate(layer_ns):
            store.save(prompt, [cache[i]], namespace=ns)
        want = _forward_layers(model, last, cache, None).item()
        nbytes = sum(c.keys.nbytes + c.values.nbytes for c in cache)
        del cache

        def restore_whole() -> list[Any]:
            c, n = store.restore(prompt)
            assert c is not None and n == len(prompt)
            return c

        def restore_layer(i: int) -> Any:
            c, n = store.restore(prompt, namespace=layer_ns[i])
            assert c is not None and n == len(prompt)
            return c[0]

        def whole() -> float:
            t = time.perf_counter()
            y = _forward_layers(model, last, restore_whole(), None)
            dt = time.perf_counter() - t
            assert y.item() == want
            return dt

        def streamed() -> float:
            t = time.perf_counter()
            caches: list[Any] = [None] * n_layers
            ready = [threading.Event() for _ in range(n_layers)]

            def reader() -> None:
                for i in range(n_layers):
                    caches[i] = restore_layer(i)
                    ready[i].set()

            th = threading.Thread(target=reader)
            th.start()
            y = _forward_layers(model, last, caches, ready)
            dt = time.perf_counter() - t
            th.join()
            assert y.item() == want
            return dt

        def per_layer() -> float:
            t = time.perf_counter()
            y = _forward_layers(model, last, [restore_layer(i) for i in range(n_layers)], None)
            dt = time.perf_counter() - t
            assert y.item() == want
            return dt

        def restore_only() -> float:
            t = time.perf_counter()
            restore_whole()
            return time.perf_counter() - t

        def forward_only() -> float:
            c = restore_whole()
            t = time.perf_counter()
            _forward_layers(model, last, c, None)
            return time.perf_counter() - t

        sides = {"whole": whole, "streamed": streamed, "per-layer": per_layer,
                 "restore alone": restore_only, "forward alone": forward_only}
        res: dict[str, list[float]] = {k: [] for k in sides}
        for rnd in range(args.reps + 1):
            order = list(sides.items())
            if rnd % 2:
                order.reverse()
            for k, fn in order:
                dt = fn()
                if rnd:
                    res[k].append(dt)
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"{args.tokens} tokens, {n_layers} layers, cache {nbytes / 2**20:.1f} MiB, "
              f"{args.reps} reps (median):")
        for k, v in med.items():
            print(f"  {k:14} {v * 1e3:8.2f} ms   (min {min(res[k]) * 1e3:.2f})")
        gain = med["whole"] / med["streamed"]
        bound = med["forward alone"] * (n_layers - 1) / n_layers
        print(f"streamed vs whole: {gain:.3f}x ({'faster' if gain > 1 else 'not faster'}); "
              f"bound on the gain: the forward minus one layer's share, {bound * 1e3:.2f} ms "
              f"of {med['whole'] * 1e3:.2f} ms")
        store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
