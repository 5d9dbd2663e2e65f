"""The checkpoint interval's trade-off, measured (issue 26): for each interval N, what the
checkpoints of one long prompt cost (bytes on disk, manifests included, and the prefill's
extra time) and what they save (question 2's recompute and time to first token).

    python tools/checkpoint_interval.py --doc 16384 --every 0 256 512 1024 2048 4096

For each tiny kind and each N (0: no checkpoints) on a fresh root: the system prompt's
state is saved, question 1 (system, document, question) is prefilled with
``kvstore.mlx_lm.prefill(every=N)`` and its end saved; then ``--edits`` prompts that part
from it at random places in the document (the same places for every N) each restore the
deepest stored prefix and prefill the rest (without saving checkpoints of their own). One
JSON object per (kind, N): q1_s (question 1, checkpoints saved on the way), checkpoints,
blocks_bytes (the root's block files), manifest_bytes (the checkpoints' encoded
manifests, which hold their token lists: O(depth) each), the edits' mean recomputed
tokens and mean time to first token, state_bytes and kv_bytes_per_token (of the model's
cache). Sides are not interleaved: run it on an otherwise idle machine and read ratios.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

SYSTEM, QUESTION = 384, 24


def measure(model: Any, kind: str, root: Path, every: int, doc: list[int], system: list[int],
            q1: list[int], edits: list[tuple[int, list[int]]]) -> dict[str, Any]:
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore import Namespace, Store
    from kvstore.mlx_lm.prefill import checkpoint_costs, prefill
    from kvstore.schema import encode_manifest

    with Store.open(root, namespace=Namespace(model_id=kind)) as store:
        cache = make_prompt_cache(model)
        model(mx.array(system)[None], cache=cache)
        mx.eval([c.state for c in cache])
        store.save(system, cache, priority="system")
        t = time.perf_counter()
        head = system + doc + q1
        c, _ = store.restore(head)
        done = prefill(model, head, c, store=store, every=every, save_end=False)
        q1_s = time.perf_counter() - t
        store.save(head, done.cache, priority="user", reuse_prefix=True)
        kv, win, state = checkpoint_costs(done.cache)
        ckpts = [e for e in store.entries() if e.priority == "checkpoint"]
        manifests = store.views.manifests([e.id for e in ckpts]).values()
        blocks = store.stats().physical_bytes
        recomputed, ttfts = [], []
        for at, tail in edits:
            t = time.perf_counter()
            prompt = system + doc[:at] + tail
            c, n = store.restore(prompt[:-1])
            done = prefill(model, prompt[:-1], c, store=store, every=0, save_end=False)
            logits = model(mx.array(prompt[-1:])[None], cache=done.cache)
            mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
            ttfts.append(time.perf_counter() - t)
            recomputed.append(len(prompt) - n)
    return {"kind": kind, "every": every, "q1_s": round(q1_s, 3), "checkpoints": len(ckpts),
            "blocks_bytes": blocks,
            "manifest_bytes": sum(len(encode_manifest(m)) for m in manifests),
            "edit_recomputed_mean": round(sum(recomputed) / len(recomputed)),
            "edit_ttft_mean_s": round(sum(ttfts) / len(ttfts), 4),
            "state_bytes": state, "kv_bytes_per_token": kv + win}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doc", type=int, default=16384, help="document tokens")
    p.add_argument("--every", type=int, nargs="+", default=[0, 256, 512, 1024, 2048, 4096])
    p.add_argument("--kinds", nargs="+", default=["lfm2", "qwen3_5", "gemma3_text"])
    p.add_argument("--edits", type=int, default=8, help="prompts that part at random places")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()

    from mlx_lm import load

    from kvstore.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvstore-interval-") as tmp:
        work = Path(tmp)
        for kind in args.kinds:
            path = make_tiny_model(work / kind, kind, hidden_size=args.hidden,
                                   num_layers=args.layers, dtype="float32")
            model = load(str(path))[0]
            cfg = getattr(model.args, "text_config", None) or vars(model.args)
            rng = np.random.default_rng(26)

            def tokens(n: int, rng: Any = rng, vocab: int = int(cfg["vocab_size"])
                       ) -> list[int]:
                return [int(t) for t in rng.integers(8, vocab, n)]

            system, doc = tokens(SYSTEM), tokens(args.doc)
            q1 = tokens(QUESTION)
            places = np.random.default_rng(7).integers(0, args.doc, args.edits)
            edits = [(int(at), tokens(QUESTION)) for at in places]
            for every in args.every:
                row = measure(model, kind, work / f"root-{kind}-{every}", every, doc, system,
                              q1, edits)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
