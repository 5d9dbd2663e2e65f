"""``kvstore demo``: a multi-session chat on a tiny local model, with and without the store.

Sessions share a long system prompt. For each request the demo prints how many
prompt tokens came from the cache, the time to first token with the store and
with a cold cache, the bytes the save wrote and the root's dedup ratio. Then a
second Python process, cold, answers a new session from the first one's cache.
By default nothing is downloaded: the model is a random-weight tiny llama made on
the spot, unless the real SmolLM2 model is already converted in the model cache
(`kvstore model fetch smollm2`); ``--model smollm2`` or ``--model DIR`` runs the
sessions on a real model and prints its replies.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from kvstore import Store
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.tiny import make_tiny_model, sample_text

__all__ = ["run_demo", "main"]

T = TypeVar("T")

SYSTEM_WORDS = 1100  # about 1.5k tokens with the tiny tokenizer
REPLY_TOKENS = 24
SESSIONS = [
    ["What is the capital of France?", "And how many days are in a week?"],
    ["Summarise the report in three risks.", "Now suggest a plan for next quarter."],
    ["Which planet is closest to the sun?", "What colour is the sky on a clear day?"],
]
SECOND_PROCESS_QUESTION = "Tell me about the river and the old mill."
# a real model gets real text, and a shorter one: every request is also timed cold
REAL_SYSTEM = (
    "You are the assistant of a small town archive. The archive keeps the parish registers, "
    "the mill's account books from 1820 to 1950, maps of the river and its three bridges, "
    "letters of the families who ran the bakery and the school, and photographs of the "
    "market square. Answer visitors briefly and politely, in one or two sentences. When a "
    "question is about the town, say which part of the archive holds the answer. When it is "
    "not, answer it plainly from general knowledge. Never invent documents, dates or names; "
    "if you do not know, say so and suggest asking the archivist, who is in on weekdays from "
    "nine to five. Opening hours: Monday to Friday, nine to five; Saturday, ten to one. "
    "Copies cost ten cents a page; photographs may be taken without flash."
)


def _progress(items: Iterable[T], *, total: int, desc: str, quiet: bool) -> Iterable[T]:
    """A tqdm bar on a terminal; the plain iterable otherwise."""
    if quiet or not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    bar: Iterable[T] = tqdm(items, total=total, desc=desc, leave=False, file=sys.stderr)
    return bar


class _Chat:
    """One model, one persistent prompt cache; times each request both ways."""

    def __init__(self, model_dir: Path, store: Store) -> None:
        import mlx_lm

        loaded = mlx_lm.load(str(model_dir))
        self.model, self.tokenizer = loaded[0], loaded[1]
        self.key = (str(model_dir), None, None)
        self.cache = PersistentPromptCache(store, min_tokens=64)

    def tokens(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(  # type: ignore[no-untyped-call]
            messages, add_generation_prompt=True
        )
        return list(ids)

    def _first_token(self, cache: list[Any], rest: list[int]) -> tuple[Any, float]:
        from mlx_lm.generate import generate_step

        t0 = time.perf_counter()
        gen = generate_step(mx.array(rest), self.model, prompt_cache=cache, max_tokens=REPLY_TOKENS)
        first = next(gen)
        return (gen, first), time.perf_counter() - t0

    def cold_ttft(self, prompt: list[int]) -> float:
        from mlx_lm.models.cache import make_prompt_cache

        _, dt = self._first_token(make_prompt_cache(self.model), prompt)
        return dt

    def request(self, prompt: list[int]) -> dict[str, Any]:
        """Serve `prompt` through the persistent cache; return what the demo prints."""
        from mlx_lm.models.cache import make_prompt_cache

        disk_hits = self.cache.persist_stats().store_hits
        t0 = time.perf_counter()
        cache, rest = self.cache.fetch_nearest_cache(self.key, prompt)
        reused = len(prompt) - len(rest)
        cache = cache if cache is not None else make_prompt_cache(self.model)
        fetch = time.perf_counter() - t0
        (gen, (tok, _)), first = self._first_token(cache, rest)
        reply = [tok] + [t for t, _ in gen]
        before = self.cache.bytes_written
        self.cache.insert_cache(self.key, prompt + reply, cache)
        self.cache.drain()  # only so the demo can print this request's bytes
        from_disk = self.cache.persist_stats().store_hits > disk_hits
        return {
            "reused": reused,
            "source": "disk" if from_disk else ("memory" if reused else "-"),
            "ttft": fetch + first,
            "bytes": self.cache.bytes_written - before,
            "reply": self.tokenizer.decode(reply),
        }


def _row(label: str, n_prompt: int, r: dict[str, Any], cold: float, ratio: float) -> str:
    speedup = cold / r["ttft"] if r["ttft"] > 0 else float("inf")
    return (
        f"{label:<14} prompt {n_prompt:>5}  reused {r['reused']:>5} ({r['source']:<6})  "
        f"ttft {r['ttft'] * 1e3:7.1f} ms (cold {cold * 1e3:7.1f} ms, x{speedup:4.1f})  "
        f"wrote {r['bytes'] / 1024:7.1f} KiB  dedup x{ratio:.2f}"
    )


def _system_prompt(real: bool = False) -> str:
    if real:
        return REAL_SYSTEM
    return "You are the assistant of a small town archive. " + sample_text(SYSTEM_WORDS, seed=11)


def _first_process(root: Path, model_dir: Path, say: Callable[[str], None], quiet: bool,
                   real: bool = False) -> None:
    system = _system_prompt(real)
    with Store.open(root) as store:
        chat = _Chat(model_dir, store)
        if (n := store.stats().entries) > 0:
            say(f"the root already holds {n} entries (from an earlier run): expect reuse at once")
        history: list[list[dict[str, str]]] = [[] for _ in SESSIONS]
        steps = [(s, turn) for turn in range(2) for s in range(len(SESSIONS))]
        for s, turn in _progress(steps, total=len(steps), desc="requests", quiet=quiet):
            msgs = history[s]
            if not msgs:
                msgs.append({"role": "system", "content": system})
            msgs.append({"role": "user", "content": SESSIONS[s][turn]})
            prompt = chat.tokens(msgs)
            cold = chat.cold_ttft(prompt)
            r = chat.request(prompt)
            msgs.append({"role": "assistant", "content": r["reply"]})
            say(
                _row(
                    f"session {s + 1} turn {turn + 1}",
                    len(prompt),
                    r,
                    cold,
                    store.stats().dedup_ratio,
                )
            )
            if real:
                say(f"    user: {SESSIONS[s][turn]}\n    model: {r['reply'].strip()}")
        chat.cache.close()
        st = store.stats()
        say(
            f"store: {st.entries} entries, {st.logical_bytes / 1024:.0f} KiB logical, "
            f"{st.physical_bytes / 1024:.0f} KiB on disk (dedup x{st.dedup_ratio:.2f})"
        )


def _second_process(root: Path, model_dir: Path, say: Callable[[str], None],
                    real: bool = False) -> int:
    """A cold process: nothing in memory, the store's entries only."""
    with Store.open(root) as store:
        chat = _Chat(model_dir, store)
        prompt = chat.tokens(
            [
                {"role": "system", "content": _system_prompt(real)},
                {"role": "user", "content": SECOND_PROCESS_QUESTION},
            ]
        )
        cold = chat.cold_ttft(prompt)
        r = chat.request(prompt)
        chat.cache.close()
        say(_row("2nd process", len(prompt), r, cold, store.stats().dedup_ratio))
        if real:
            say(f"    user: {SECOND_PROCESS_QUESTION}\n    model: {r['reply'].strip()}")
        return 0 if r["reused"] > 0 else 1


def _python() -> list[str]:
    """The interpreter for a child that must import this very kvstore package.

    ``-P`` keeps the current directory off the child's ``sys.path``, so a folder
    named ``kvstore`` there cannot shadow the installed package; unless this
    package itself lives in the current directory (a checkout run in place).
    """
    import kvstore

    home = Path(kvstore.__file__).resolve().parent.parent
    return [sys.executable] if home == Path.cwd().resolve() else [sys.executable, "-P"]


def _real_model(model: str | None, say: Callable[[str], None]) -> Path | None:
    """The real model's directory for ``--model``; None for the tiny model."""
    from kvstore.mlx_lm.gguf import MODELS, cached_model, fetch_model

    if model is None:
        if (found := cached_model("smollm2")) is not None:
            say(f"using the real model smollm2 ({MODELS['smollm2'].description}), "
                f"already fetched: {found}")
        return found
    if model in MODELS:
        d = fetch_model(model, log=say)
        say(f"using the real model {model} ({MODELS[model].description}): {d}")
        return d
    say(f"using the model {model}")
    return Path(model)


def run_demo(root: str | Path, *, quiet: bool = False, model: str | None = None) -> int:
    """Run the demo against the cache root `root`; 0 when the second process reused the cache.

    `model`: None (the tiny model, or smollm2 when it is already fetched), a known
    model name (``smollm2``) or an mlx-lm model directory.
    """
    say: Callable[[str], None] = (lambda s: None) if quiet else print
    root = Path(root)
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        real_dir = _real_model(model, say)
        real = real_dir is not None
        if real_dir is not None:
            model_dir = real_dir
            say(f"cache root {root}")
        else:
            model_dir = make_tiny_model(Path(tmp) / "tiny-llama", "llama")
            say(f"tiny llama model (random weights) in a temp dir; cache root {root}")
        _first_process(root, model_dir, say, quiet, real)
        say("starting a second Python process (cold) on the same root ...")
        argv = [
            *_python(),
            "-m",
            "kvstore.demo",
            "--second",
            "--root",
            str(root),
            "--model",
            str(model_dir),
        ]
        if quiet:
            argv.append("--quiet")
        if real:
            argv.append("--real")
        done = subprocess.run(argv, stdout=None if not quiet else subprocess.DEVNULL)
        if done.returncode != 0:
            say("the second process did not reuse the cache")
        return int(done.returncode)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.demo``: the whole demo, or (``--second``) its second process."""
    p = argparse.ArgumentParser(prog="python -m kvstore.demo")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--second", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--real", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.second:
        if args.model is None:
            p.error("--second needs --model")
        say: Callable[[str], None] = (lambda s: None) if args.quiet else print
        return _second_process(args.root, args.model, say, args.real)
    return run_demo(args.root, quiet=args.quiet)


if __name__ == "__main__":
    sys.exit(main())
