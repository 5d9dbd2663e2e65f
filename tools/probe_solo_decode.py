"""What a lone request's decode step costs in ``kvstore serve``'s engine: alone on its own
caches (``Engine(solo=True)``, the default) or as a batch of one (``solo=False``), with
mlx-lm's ``BatchGenerator`` driven bare beside them.

    python tools/probe_solo_decode.py [--reps 10] [--tokens 1024] [--prompt 300]

On the serve bench's tiny llama (``kvstore.bench.serve_cases.tiny_model``: 2 layers of
hidden 32, where a step is about a millisecond and what is done around it shows), each
side generates ``--tokens`` tokens after a new ``--prompt``-token prompt, greedy, not
streamed; the figure is the time from its first token to its last over the tokens between.
The sides run in interleaved rounds (the order reversed every other round) after one
warm-up each; medians and each round's ratio to the batch of one are printed. Nothing here
changes kvstore.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx_lm
from mlx_lm.generate import BatchGenerator

import kvstore
from kvstore.bench.serve_cases import tiny_model
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.server.engine import Done, Engine, Job, Token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = tiny_model(Path(d) / "tiny")
        model, tok = mlx_lm.load(str(path))
        seeds = iter(range(1, 1 << 30))

        def prompt() -> list[int]:
            s = next(seeds)  # a new prompt each time: nothing comes from the cache
            return [5 + (s * 7919 + i * 31) % 700 for i in range(args.prompt)]

        with kvstore.Store.open(Path(d) / "root", durable=False) as store:
            engines = {solo: Engine(model, tok, PersistentPromptCache(store, min_tokens=1 << 30),
                                    model_key=(str(path), None, None), solo=solo)
                       for solo in (True, False)}
            for e in engines.values():
                e.start()

            def engine(solo: bool) -> float:
                h = engines[solo].submit(Job(prompt(), args.tokens, streamed=False))
                first = None
                n = 0
                while True:
                    ev = h.get(120)
                    if isinstance(ev, Token):
                        n += 1
                        first = first or time.perf_counter()
                    elif isinstance(ev, Done):
                        break
                assert first is not None and n == args.tokens, (n, ev)
                return (time.perf_counter() - first) / (n - 1) * 1e3

            def bare() -> float:
                bg = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
                bg.insert([prompt()], max_tokens=[args.tokens])
                first, n, done = None, 0, False
                while not done:
                    for r in bg.next()[1]:
                        n += 1
                        first = first or time.perf_counter()
                        done = done or r.finish_reason is not None
                bg.close()
                assert first is not None
                return (time.perf_counter() - first) / (n - 1) * 1e3

            sides: dict[str, Callable[[], float]] = {
                "engine, alone (solo)": lambda: engine(True),
                "engine, a batch of one": lambda: engine(False),
                "BatchGenerator, bare": bare,
            }
            for f in sides.values():
                f()
            got: dict[str, list[float]] = {k: [] for k in sides}
            for r in range(args.reps):
                for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
                    got[name].append(sides[name]())
            for e in engines.values():
                e.stop(30)
    base = got["engine, a batch of one"]
    print(f"ms a token, {args.tokens} tokens after a {args.prompt}-token prompt, "
          f"{args.reps} rounds:")
    for name, v in got.items():
        print(f"  {name:24} median {statistics.median(v):.3f}  "
              + " ".join(f"{x:.2f}" for x in v))
    ratios = [a / b for a, b in zip(got["engine, alone (solo)"], base, strict=True)]
    print("  alone / batch of one, each round: " + " ".join(f"{x:.2f}" for x in ratios)
          + f"  (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
