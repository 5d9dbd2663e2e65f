"""Figures on the real model (SmolLM2-135M-Instruct, converted by ``kvstore model fetch``).

1. Time to first token for an N-token prompt: prefill from nothing vs restore from
   the store in a process whose memory holds nothing (then one token of prefill).
2. A 6-turn conversation (system prompt + user turns, whole history per request):
   total prompt-processing time (the sum of the time to first token) and the cached
   share per turn, for: no cache; mlx-lm's in-memory ``LRUPromptCache`` (what plain
   ``mlx_lm.server`` does); the store with a cold memory at every turn (each turn a
   new process, e.g. after a restart or on another server: every hit comes from disk).
   The modes run turn by turn in turn, so machine noise hits them alike.

    python tools/bench_smollm2.py [--tokens 4096] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from kvstore import Store
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.mlx_lm.gguf import fetch_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "model"))
from test_openai_e2e import SYSTEM, TURNS  # noqa: E402  (the e2e suite's conversation)

REPLY = 8


def _first(model: Any, cache: list[Any], rest: list[int], n: int = 1) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    gen = generate_step(mx.array(rest), model, prompt_cache=cache, max_tokens=n)
    tok, _ = next(gen)
    dt = time.perf_counter() - t0
    return [int(tok)] + [int(t) for t, _ in gen], dt


def ttft(model: Any, tok: Any, root: Path, n: int, repeat: int) -> dict[str, Any]:
    ids = tok.encode((SYSTEM + " ") * (n // 150 + 2))[: n + 1]
    key = ("smollm2", None, None)
    prefill, restore = [], []
    with Store.open(root, create=True) as store:
        cache = make_prompt_cache(model)
        _first(model, cache, ids[:n])
        saver = PersistentPromptCache(store, min_tokens=1)
        saver.insert_cache(key, ids[:n], cache)
        saver.close()
        for i in range(repeat + 1):  # round 0 warms the restore path up (page cache, imports)
            if i > 0:
                prefill.append(_first(model, make_prompt_cache(model), ids)[1])
            cold = PersistentPromptCache(store, min_tokens=1)  # nothing in memory
            t0 = time.perf_counter()
            got, rest = cold.fetch_nearest_cache(key, ids)
            assert got is not None and len(rest) == 1, len(rest)
            _first(model, got, rest)
            if i > 0:
                restore.append(time.perf_counter() - t0)
            cold.close()
    return {"tokens": n, "prefill_s": statistics.median(prefill),
            "restore_s": statistics.median(restore), "repeat": repeat}


def conversation(model: Any, tok: Any, root: Path) -> dict[str, Any]:
    key = ("smollm2", None, None)
    modes = ["none", "lru", "store-cold"]
    hist = {m: [{"role": "system", "content": SYSTEM}] for m in modes}
    lru = LRUPromptCache(10)
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with Store.open(root, create=True) as store:
        for user in TURNS:
            for m in modes:
                hist[m].append({"role": "user", "content": user})
                prompt = list(tok.apply_chat_template(hist[m], add_generation_prompt=True))
                t0 = time.perf_counter()
                if m == "none":
                    cache, rest = None, prompt
                elif m == "lru":
                    cache, rest = lru.fetch_nearest_cache(key, prompt)
                else:
                    ppc = PersistentPromptCache(store, min_tokens=1)  # a cold process
                    cache, rest = ppc.fetch_nearest_cache(key, prompt)
                cached = len(prompt) - len(rest)
                cache = cache if cache is not None else make_prompt_cache(model)
                fetched = time.perf_counter() - t0
                reply, first = _first(model, cache, rest, REPLY)
                dt = fetched + first  # lookup/restore + prefill of the rest + the first token
                if m == "lru":
                    lru.insert_cache(key, prompt + reply, cache)
                elif m == "store-cold":
                    ppc.insert_cache(key, prompt + reply, cache)
                    ppc.close()
                hist[m].append({"role": "assistant", "content": tok.decode(reply)})
                rows[m].append({"prompt": len(prompt), "cached": cached, "share":
                                cached / len(prompt), "ttft_s": dt})
    return {m: {"total_s": sum(r["ttft_s"] for r in rows[m]), "turns": rows[m]} for m in modes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--skip-ttft", action="store_true")
    args = p.parse_args(argv)
    model, tok = mlx_lm.load(str(fetch_model("smollm2", log=print)))[:2]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        if not args.skip_ttft:
            out["ttft"] = t = ttft(model, tok, Path(tmp) / "a", args.tokens, args.repeat)
            print(f"ttft {t['tokens']} tokens: prefill {t['prefill_s']:.2f} s, restore "
                  f"{t['restore_s']:.3f} s (x{t['prefill_s'] / t['restore_s']:.0f}); "
                  f"median of {args.repeat}", flush=True)
        out["conversation"] = c = conversation(model, tok, Path(tmp) / "b")
    for m, r in c.items():
        shares = " ".join(f"{x['share']:.0%}" for x in r["turns"])
        print(f"6 turns, {m:<10}: prompt processing {r['total_s']:6.2f} s; cached share {shares}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
