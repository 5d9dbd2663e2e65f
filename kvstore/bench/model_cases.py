"""The ``model`` group (``kvstore bench --model smollm2|DIR``): figures on a real model.

1. Time to first token for a ``cfg.model_tokens``-token prompt: prefill from nothing
   vs restore from the store (from the page cache, and after the block files were
   evicted from it) and one step on the last token. Both sides must give the same
   first token.
2. A 6-turn conversation (a system prompt, a user turn each time, the whole history
   per request, replies of `REPLY_TOKENS`): the total prompt-processing time (the sum
   of each turn's time to first token) for the store with a cold memory at every
   turn (a new ``PersistentPromptCache`` each turn: every hit comes from disk, as
   after a restart or on another server), mlx-lm's in-memory ``LRUPromptCache``
   (what plain ``mlx_lm.server`` keeps) and no cache; and the share of each turn's
   prompt that came from a cache. The three run turn by turn, in a rotating order,
   so the machine's noise falls on them alike.
3. The same conversation through ``kvstore serve`` (a subprocess, as users run it): the
   bytes written per request and against the final conversation's KV bytes, with the
   default write-behind and with every snapshot written at once (:mod:`.write_cost`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

from ..demo import REAL_SYSTEM
from ..store import Store
from .common import Config, Row, block_files, drop_from_page_cache, median
from .write_cost import write_cost_rows

Log = Callable[[str], None]

# The conversation: the demo's archive assistant, six short questions; the OpenAI-client
# suite (tests/model/test_openai_e2e.py) drives the same one through kvstore serve
SYSTEM = REAL_SYSTEM
TURNS = (
    "What is the capital of France?",
    "Where can I find the mill's account books?",
    "When is the archivist in?",
    "How much does a copy cost?",
    "Can I take photographs?",
    "Thank you. What is two plus two?",
)
REPLY_TOKENS = 8
PREFILL_STEP = 2048  # mlx-lm's generate_step prefills in chunks of this many tokens
MODES = ("store", "lru", "none")

# mlx-lm's modules are untyped: typed handles for what the cases use
make_prompt_cache: Any = _mlx_cache.make_prompt_cache
trim_prompt_cache: Any = _mlx_cache.trim_prompt_cache
LRUPromptCache: Any = _mlx_cache.LRUPromptCache


def resolve_model(spec: str, log: Log = print) -> Path:
    """The mlx-lm directory of ``--model``: a known name (fetched on first use) or a path."""
    from ..mlx_lm.gguf import MODELS, fetch_model

    if spec in MODELS:
        return fetch_model(spec, log=log)
    path = Path(spec)
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"--model {spec}: neither a known model ({known}) nor an mlx-lm "
                         f"model directory (no {path / 'config.json'})")
    return path


def first_token(model: Any, cache: list[Any], tokens: list[int],
                progress: Log | None = None) -> int:
    """Process ``tokens`` on ``cache`` as mlx-lm's generate_step does (all but the last in
    chunks, the cache evaluated after each) and return the greedy first token."""
    arr = mx.array(tokens)[None]
    pos, last = 0, len(tokens) - 1
    t0 = time.perf_counter()
    while pos < last:
        step = min(PREFILL_STEP, last - pos)
        model(arr[:, pos : pos + step], cache=cache)
        mx.eval([c.state for c in cache])
        pos += step
        if progress is not None and pos < last:  # minutes per chunk on a CPU
            progress(f"  prefill: {pos}/{len(tokens)} tokens in {time.perf_counter() - t0:.1f} s")
    return _greedy(model(arr[:, last:], cache=cache))


def _greedy(logits: mx.array) -> int:
    token: Any = mx.argmax(logits[0, -1, :]).item()  # an int for an integer array
    return int(token)


def _reply(model: Any, cache: list[Any], first: int, eos: set[int]) -> list[int]:
    """Greedy decoding from ``first`` up to `REPLY_TOKENS` tokens, each fed to ``cache``
    (a stop token is not fed: mlx-lm's cache of a finished reply does not hold it)."""
    reply = [first]
    while reply[-1] not in eos:
        logits = model(mx.array([[reply[-1]]]), cache=cache)
        if len(reply) == REPLY_TOKENS:
            mx.eval([c.state for c in cache])
            break
        reply.append(_greedy(logits))
    return reply if reply[-1] not in eos else reply[:-1]


def model_rows(cfg: Config, scratch: Path, model_dir: Path, log: Log = print) -> list[Row]:
    """The TTFT rows and the conversation rows of the model in ``model_dir``."""
    import mlx_lm

    loaded = mlx_lm.load(str(model_dir))
    model, tok = loaded[0], loaded[1]
    label = model_dir.name
    mx.eval(model(mx.array([[1, 2, 3, 4]]))[0, -1])  # MLX's first call sets itself up
    root = Path(tempfile.mkdtemp(prefix="model-", dir=scratch))
    load = os.getloadavg()[0]  # other work on the machine slows the prefill most
    try:
        rows = ttft_rows(cfg, root / "ttft", model, tok, model_dir, label, log)
        rows += conversation_rows(root / "conversation", model, tok, model_dir, label, log)
        rows += write_cost_rows(root / "write-cost", model_dir, label, SYSTEM, TURNS,
                                REPLY_TOKENS, log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        r.extra.update(loadavg_start=load, loadavg_end=os.getloadavg()[0])
    return rows


def _ttft_prompt(tok: Any, n: int) -> list[int]:
    text = (SYSTEM + " ") * (n // 100 + 2)  # the system prompt is ~150 tokens
    ids = [int(t) for t in tok.encode(text)][:n]
    assert len(ids) == n, (len(ids), n)
    return ids


def ttft_rows(cfg: Config, root: Path, model: Any, tok: Any, model_dir: Path, label: str,
              log: Log) -> list[Row]:
    """Prefill once (the prefill of n tokens on a CPU takes minutes), save the state before
    the last token, then restore it ``cfg.model_reps`` times from the page cache and as
    many after eviction; every side's first token is the prefill's."""
    from ..mlx_lm import namespace_for_path

    n = cfg.model_tokens
    ids = _ttft_prompt(tok, n)
    ns = namespace_for_path(model_dir)
    log(f"[model] {label}: prefill of {n} tokens (timed once) ...")
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    want = first_token(model, cache, ids, log)
    prefill = time.perf_counter() - t0
    log(f"  prefill {n} tokens: {prefill:.2f} s ({prefill / n * 1e3:.1f} ms per token), "
        f"first token {want} {tok.decode([want])!r}")
    trim_prompt_cache(cache, 1)  # the state before the last token, as a restore leaves it
    kv_bytes = sum(c.keys.nbytes // c.keys.shape[2] + c.values.nbytes // c.values.shape[2]
                   for c in cache) * (n - 1)
    sides: dict[str, list[float]] = {"from page cache": [], "after eviction": []}
    with Store.open(root, namespace=ns) as store:
        store.save(ids[:-1], cache)
        del cache

        def restore(evict: bool) -> float:
            if evict:
                drop_from_page_cache(block_files(root))
            t = time.perf_counter()
            c, length = store.restore(ids)
            assert c is not None and length == n - 1, length
            got = first_token(model, c, ids[length:])
            dt = time.perf_counter() - t
            assert got == want, f"the restored cache gave token {got}, the prefill {want}"
            return dt

        restore(False)  # warm-up: imports, the restore path's first allocations
        for rnd in range(cfg.model_reps):
            order = list(sides)
            for side in order if rnd % 2 == 0 else order[::-1]:
                sides[side].append(restore(side == "after eviction"))
    rows = []
    for side, times in sides.items():
        extra = {"tokens": float(n), "kv_bytes": float(kv_bytes), "first_token": float(want),
                 "restore_reps": float(len(times)), "prefill_reps": 1.0,
                 "prefill_ms_per_token": prefill / n * 1e3}
        rows.append(Row("model", f"time to first token, {n} tokens, restore {side} "
                        f"({label})", "s", median(times), prefill, "prefill from scratch",
                        "speedup", extra=extra))
    return rows


def conversation_rows(root: Path, model: Any, tok: Any, model_dir: Path, label: str,
                      log: Log) -> list[Row]:
    """The 6-turn conversation in each mode; the rows compare the store's total with the
    LRU's and with no cache's, and carry each mode's cached share per turn."""
    from ..mlx_lm import PersistentPromptCache

    key = (str(model_dir), None, None)  # the key mlx_lm.server passes
    eos = {int(t) for t in tok.eos_token_ids}
    hist = {m: [{"role": "system", "content": SYSTEM}] for m in MODES}
    lru = LRUPromptCache(10)
    turns: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    save_s = 0.0
    log(f"[model] {label}: {len(TURNS)}-turn conversation, replies of {REPLY_TOKENS} tokens; "
        "store (cold memory each turn) vs mlx-lm LRUPromptCache vs no cache")
    with Store.open(root) as store:
        for i, user in enumerate(TURNS):
            for m in MODES[i % len(MODES):] + MODES[: i % len(MODES)]:
                hist[m].append({"role": "user", "content": user})
                prompt = [int(t) for t in
                          tok.apply_chat_template(hist[m], add_generation_prompt=True)]
                ppc = None
                if m == "store":  # a new process's cache: nothing in memory
                    ppc = PersistentPromptCache(store, min_tokens=1)
                    ppc.namespace_for(key)  # a server fingerprints its model once, at start
                t0 = time.perf_counter()
                if ppc is not None:
                    cache, rest = ppc.fetch_nearest_cache(key, prompt)
                elif m == "lru":
                    cache, rest = lru.fetch_nearest_cache(key, prompt)
                else:
                    cache, rest = None, prompt
                assert rest, "a cache answered the whole prompt: the turns must differ"
                cache = cache if cache is not None else make_prompt_cache(model)
                first = first_token(model, cache, rest)
                dt = time.perf_counter() - t0
                reply = _reply(model, cache, first, eos)
                if ppc is not None:
                    ppc.insert_cache(key, prompt + reply, cache)
                    t1 = time.perf_counter()
                    ppc.close()  # wait for the write-behind save (a server does not)
                    save_s += time.perf_counter() - t1
                    assert ppc.saved == 1 and ppc.failed == 0, ppc.persist_stats().summary()
                elif m == "lru":
                    lru.insert_cache(key, prompt + reply, cache)
                cached = len(prompt) - len(rest)
                if m == "store":
                    done = tok.decode(rest) if len(rest) <= 60 else "…" + tok.decode(rest[-30:])
                    log(f"  turn {i + 1}: {cached}/{len(prompt)} tokens from the store; "
                        f"processed: {done!r}; reply {len(reply)} tokens"
                        f"{'' if len(reply) == REPLY_TOKENS else ' and the stop token'}")
                hist[m].append({"role": "assistant", "content": tok.decode(reply)})
                turns[m].append({"prompt": float(len(prompt)), "cached": float(cached),
                                 "share": cached / len(prompt), "ttft_s": dt,
                                 "reply": float(len(reply))})
    total = {m: sum(t["ttft_s"] for t in turns[m]) for m in MODES}
    for m in MODES:
        shares = " ".join(f"{t['share']:.0%}" for t in turns[m])
        log(f"  {m:<5}: prompt processing {total[m]:.2f} s; cached share per turn {shares}")
    extra: dict[str, float] = {"turns": float(len(TURNS)), "reply_tokens": float(REPLY_TOKENS),
                               "store_save_s": save_s}
    for m in MODES:
        extra[f"{m}_total_s"] = total[m]
        for i, t in enumerate(turns[m], 1):
            extra[f"{m}_turn{i}_prompt"] = t["prompt"]
            extra[f"{m}_turn{i}_cached"] = t["cached"]
            extra[f"{m}_turn{i}_share"] = t["share"]
            extra[f"{m}_turn{i}_ttft_s"] = t["ttft_s"]
            extra[f"{m}_turn{i}_reply"] = t["reply"]  # tokens fed (a stop token is not)
    name = f"{len(TURNS)}-turn conversation, prompt processing, store (cold memory each turn)"
    return [
        Row("model", f"{name} vs no cache ({label})", "s", total["store"], total["none"],
            "no cache (every turn prefilled)", "speedup", extra=dict(extra)),
        Row("model", f"{name} vs mlx-lm LRUPromptCache ({label})", "s", total["store"],
            total["lru"], "mlx-lm's in-memory LRUPromptCache (plain mlx_lm.server)",
            "speedup", extra=dict(extra)),
    ]
