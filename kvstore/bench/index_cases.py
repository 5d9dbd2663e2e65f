"""Index and model cases: lookup latency as entries grow (and its limit), restore vs
recompute (TTFT)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as _mlx_cache

from ..schema import Namespace
from ..store import Store
from .common import Config, Row, interleave, median, percentile
from .limits import lookup_limit_rows

LOOKUP_NS = Namespace(model_id="kvstore-bench-lookup")
VOCAB = 32000

# mlx-lm's cache module is untyped: typed handles for what the cases use
KVCache: Any = _mlx_cache.KVCache



class LookupCorpus:
    """Entries with realistic token counts that share prefixes.

    Every entry is one of a few system prompts (512-4096 tokens) followed by
    its own conversation (64-4096 tokens); the caches are tiny (1 layer,
    B1 H1 D8) so that 100k of them fit, but their keys follow the tokens, so
    shared prefixes share blocks as real caches would.
    """

    def __init__(self, root: Path) -> None:
        self.rng = np.random.default_rng(1234)
        self.prompts = [self._tokens(int(n)) for n in self.rng.choice([512, 1024, 2048, 4096], 64)]
        self.entries: list[np.ndarray] = []
        self.store = Store.open(root, namespace=LOOKUP_NS, durable=False)

    def _tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, n, dtype=np.uint32)

    def grow_to(self, n: int) -> None:
        """Save entries until there are ``n``."""
        while len(self.entries) < n:
            p = self.prompts[int(self.rng.integers(len(self.prompts)))]
            own = self._tokens(int(self.rng.integers(64, 4097)))
            toks = np.concatenate([p, own])
            c = KVCache()
            kv = mx.array(toks.astype(np.float32)).astype(mx.bfloat16).reshape(1, 1, -1, 1)
            kv = mx.broadcast_to(kv, (1, 1, len(toks), 8))
            c.update_and_fetch(kv, kv)
            mx.eval(c.keys, c.values)
            self.store.save(toks, [c])
            self.entries.append(toks)

    def queries(self, count: int, length: int) -> list[tuple[np.ndarray, int]]:
        """Queries of ``length`` tokens extending stored entries, with the expected match."""
        out = []
        for _ in range(count):
            e = self.entries[int(self.rng.integers(len(self.entries)))]
            q = np.concatenate([e, self._tokens(max(0, length - len(e)))])[:length]
            out.append((q, min(len(e), length)))
        return out

    def close(self) -> None:
        self.store.close()


def _scan(entries: list[np.ndarray], q: np.ndarray) -> int:
    """The baseline: the longest common prefix with every stored token list, one by one."""
    best = 0
    for e in entries:
        m = min(len(e), len(q))
        diff = np.flatnonzero(e[:m] != q[:m])
        lcp = int(diff[0]) if len(diff) else m
        best = max(best, lcp)
    return best


def lookup_rows(cfg: Config, scratch: Path) -> list[Row]:
    """p50 and p99 lookup latency for a long query as the number of entries grows."""
    root = Path(tempfile.mkdtemp(prefix="lookup-", dir=scratch))
    corpus = LookupCorpus(root)
    rows: list[Row] = []
    try:
        for n in cfg.lookup_entries:
            t0 = time.perf_counter()
            corpus.grow_to(n)
            fill_s = time.perf_counter() - t0
            qs = corpus.queries(cfg.lookup_reps, cfg.lookup_query)
            for q, _ in qs[:20]:  # warm up
                corpus.store.lookup(q)
            kv: list[float] = []
            for q, want in qs:
                t = time.perf_counter()
                m = corpus.store.lookup(q)
                kv.append(time.perf_counter() - t)
                assert m is not None and m.length >= want, "lookup missed a stored prefix"
            base: list[float] = []
            for q, want in qs[: cfg.scan_reps]:
                t = time.perf_counter()
                got = _scan(corpus.entries, q)
                base.append(time.perf_counter() - t)
                assert got >= want
            label = f"{n // 1000}k" if n >= 1000 else str(n)
            extra = {"entries": float(n), "fill_s": fill_s}
            scan = "linear scan of every entry's tokens (in memory)"
            what = f"{label} entries, {cfg.lookup_query} token query"
            rows.append(Row("lookup", f"lookup p50, {what}", "s", median(kv), median(base), scan,
                            "speedup", extra=dict(extra)))
            rows.append(Row("lookup", f"lookup p99, {what}", "s", percentile(kv, 0.99),
                            percentile(base, 0.99), scan, "speedup", extra=dict(extra)))
            if n == cfg.lookup_entries[-1]:  # the machine's limit on the same reads (issue 16)
                rows.extend(lookup_limit_rows(corpus.store, [q for q, _ in qs], what))
    finally:
        corpus.close()
        shutil.rmtree(root, ignore_errors=True)
    return rows


# --- restore vs recompute -------------------------------------------------------------------


def _tiny_model(cfg: Config, scratch: Path) -> tuple[Any, str]:
    """A tiny random-weight llama (kvstore.tiny), in float32: on a CPU, MLX's bfloat16
    matmuls are emulated and would flatter the restore side by making prefill an order
    of magnitude slower."""
    from mlx_lm import load

    from ..tiny import make_tiny_model

    path = make_tiny_model(scratch / "tiny-llama", kind="llama", hidden_size=cfg.model_hidden,
                           num_layers=cfg.model_layers, dtype="float32")
    model = load(str(path))[0]
    return model, "kvstore.tiny llama"


def _prefill(model: Any, tokens: list[int], step: int = 2048) -> mx.array:
    """mlx-lm style prefill in chunks of ``step``; returns the first generated token."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    arr = mx.array(tokens)[None]
    pos = 0
    while arr.shape[1] - pos > step:
        model(arr[:, pos : pos + step], cache=cache)
        mx.eval([c.state for c in cache])
        pos += step
    logits = model(arr[:, pos:], cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)
    return y


def ttft_rows(cfg: Config, scratch: Path) -> list[Row]:
    """Time to first token: prefill from scratch vs restore the prompt's cache + one step."""
    from mlx_lm.models.cache import make_prompt_cache

    model, label = _tiny_model(cfg, scratch)
    vocab = int(model.args.vocab_size)
    root = Path(tempfile.mkdtemp(prefix="ttft-", dir=scratch))
    ns = Namespace(model_id="kvstore-bench-tiny-llama")
    rows = []
    try:
        with Store.open(root, namespace=ns) as store:
            for n in cfg.ttft_sizes:
                rng = np.random.default_rng(n)
                tokens = [int(t) for t in rng.integers(4, vocab, n)]
                cache = make_prompt_cache(model)  # the state before the last prompt token
                model(mx.array(tokens[:-1])[None], cache=cache)
                mx.eval([c.state for c in cache])
                store.save(tokens[:-1], cache)
                want = _prefill(model, tokens)

                def restore(tokens: list[int] = tokens, want: mx.array = want) -> float:
                    t = time.perf_counter()
                    c, length = store.restore(tokens)
                    assert c is not None and length == len(tokens) - 1
                    logits = model(mx.array(tokens[length:])[None], cache=c)
                    y = mx.argmax(logits[:, -1, :], axis=-1)
                    mx.eval(y)
                    dt = time.perf_counter() - t
                    assert y.item() == want.item(), "the restored cache gave another token"
                    return dt

                def prefill(tokens: list[int] = tokens) -> float:
                    t = time.perf_counter()
                    _prefill(model, tokens)
                    return time.perf_counter() - t

                res = interleave({"kv": restore, "pf": prefill}, cfg.ttft_reps)
                extra = {"hidden": float(cfg.model_hidden), "layers": float(cfg.model_layers)}
                rows.append(Row("ttft", f"time to first token, {n} tokens ({label}, "
                                f"hidden {cfg.model_hidden}, {cfg.model_layers} layers)", "s",
                                median(res["kv"]), median(res["pf"]), "prefill from scratch",
                                "speedup", extra=extra))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows
