"""``kvstore demo``: a multi-session chat on a tiny local model, with and without the store.

Sessions share a long system prompt. For each request the demo prints how many
prompt tokens came from the cache, the time to first token with the store and,
when something was reused, the same prompt prefilled from nothing (measured, not
estimated), the bytes the save wrote and the root's dedup ratio. Then a second
Python process, cold, answers a new session from the first one's cache, and the
demo says how many leading tokens the sessions share and how many whole blocks
that is (dedup needs at least one). Replies stop at the model's end of turn.

The model is always said, with why: by default the random-weight tiny llama made
on the spot (nothing is downloaded, it takes seconds); ``--model smollm2`` or
``--model DIR`` runs the sessions on a real model (two sessions, as every cold
prefill takes seconds to minutes on a CPU) and prints its replies. Ctrl-C stops
both processes with one line and no traceback.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from kvstore import Store
from kvstore.errors import KVStoreError
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.tiny import make_tiny_model, sample_text

__all__ = ["demo_root", "run_demo", "main"]

T = TypeVar("T")

SYSTEM_WORDS = 1100  # about 1.5k tokens with the tiny tokenizer
REPLY_TOKENS = 24
SESSIONS = [
    ["What is the capital of France?", "And how many days are in a week?"],
    ["Summarise the report in three risks.", "Now suggest a plan for next quarter."],
    ["Which planet is closest to the sun?", "What colour is the sky on a clear day?"],
]
SECOND_PROCESS_QUESTION = "Tell me about the river and the old mill."
# a real model gets real text, two sessions and a shorter prompt: each request that reuses
# a prefix is also prefilled from nothing, which takes seconds to minutes on a CPU
REAL_SESSIONS = 2
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
# the demo's real prompt goes on (the bench's model group and tests/model keep the text
# above): with it the sessions share more than one block of 256 tokens, so dedup shows
REAL_MORE = (
    "The reading room "
    "has twelve seats and two microfilm readers; bring a pencil, as ink is not allowed near "
    "the registers. Children under twelve visit with an adult. The archive also answers "
    "letters: replies take about two weeks, and a search of the registers costs five "
    "dollars an hour. Researchers from out of town may book a seat a week ahead by phone. "
    "The building was the old customs house; its cellar holds the bound newspapers from "
    "1870 on, which are fetched twice a day, at ten and at two. Donations of family papers "
    "are welcome: the archivist will look at them and write a receipt."
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
        self.eos = set(getattr(self.tokenizer, "eos_token_ids", ()) or ())

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

    def _reply(self, first: int, gen: Iterable[tuple[Any, Any]]) -> list[int]:
        """The generated tokens up to and with the model's end of turn (or REPLY_TOKENS).

        The end-of-turn token is kept: the cache holds it, and the next turn's template
        repeats it."""
        reply = [first]
        if first not in self.eos:
            for t, _ in gen:
                reply.append(int(t))
                if t in self.eos:
                    break
        return reply

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
        reply = self._reply(int(tok), gen)
        before = self.cache.bytes_written
        self.cache.insert_cache(self.key, prompt + reply, cache)
        self.cache.drain()  # only so the demo can print this request's bytes
        from_disk = self.cache.persist_stats().store_hits > disk_hits
        text = [t for t in reply if t not in self.eos]
        return {
            "reused": reused,
            "source": "disk" if from_disk else ("memory" if reused else "-"),
            "ttft": fetch + first,
            "bytes": self.cache.bytes_written - before,
            "reply": self.tokenizer.decode(text),
            "ended": reply[-1] in self.eos,
        }


def _row(label: str, n_prompt: int, r: dict[str, Any], cold: float | None, ratio: float) -> str:
    """One request; `cold` is the same prompt prefilled from nothing, None when nothing was
    reused (then this request is itself the cold one: there is no speedup to claim)."""
    if cold is None:
        timing = f"ttft {r['ttft'] * 1e3:7.1f} ms (nothing reused: this is the cold time)"
    else:
        speedup = cold / r["ttft"] if r["ttft"] > 0 else float("inf")
        timing = f"ttft {r['ttft'] * 1e3:7.1f} ms (cold {cold * 1e3:7.1f} ms, x{speedup:4.1f})"
    return (
        f"{label:<14} prompt {n_prompt:>5}  reused {r['reused']:>5} ({r['source']:<6})  "
        f"{timing}  wrote {r['bytes'] / 1024:7.1f} KiB  dedup x{ratio:.2f}"
    )


def _shared_line(prompts: Sequence[Sequence[int]], block_tokens: int, ratio: float) -> str:
    """How many leading tokens every session shares, and what that is in whole blocks:
    only whole blocks are stored once (so a shared prompt shorter than one block shows
    no dedup, and the demo says so instead of leaving ``x1.00`` unexplained)."""
    def common(a: Sequence[int], b: Sequence[int]) -> int:
        n = min(len(a), len(b))
        return next((i for i in range(n) if a[i] != b[i]), n)

    shared = min((common(prompts[0], p) for p in prompts[1:]), default=len(prompts[0]))
    blocks = shared // block_tokens
    if blocks == 0:
        return (f"the sessions share their first {shared} tokens (system prompt and template), "
                f"less than one block of {block_tokens}: no block is shared, so nothing is "
                "deduplicated (a shared prompt of a block or more is)")
    return (f"the sessions share their first {shared} tokens (system prompt and template): "
            f"{blocks} whole block{'s' if blocks > 1 else ''} of {block_tokens} tokens, stored "
            f"once for every entry that starts with them (dedup x{ratio:.2f})")


def _say_reply(say: Callable[[str], None], user: str, r: dict[str, Any]) -> None:
    end = "" if r["ended"] else f" [cut at {REPLY_TOKENS} tokens]"
    say(f"    user: {user}\n    model: {r['reply'].strip()}{end}")


def _system_prompt(real: bool = False) -> str:
    if real:
        return f"{REAL_SYSTEM} {REAL_MORE}"
    return "You are the assistant of a small town archive. " + sample_text(SYSTEM_WORDS, seed=11)


def _first_process(root: Path, model_dir: Path, say: Callable[[str], None], quiet: bool,
                   real: bool = False) -> None:
    system = _system_prompt(real)
    sessions = SESSIONS[:REAL_SESSIONS] if real else SESSIONS
    with Store.open(root) as store:
        chat = _Chat(model_dir, store)
        try:
            if (n := store.stats().entries) > 0:
                say(f"the root already holds {n} entries (from an earlier run): expect reuse at "
                    "once")
            history: list[list[dict[str, str]]] = [[] for _ in sessions]
            firsts: list[list[int]] = []
            steps = [(s, turn) for turn in range(2) for s in range(len(sessions))]
            for s, turn in _progress(steps, total=len(steps), desc="requests", quiet=quiet):
                msgs = history[s]
                if not msgs:
                    msgs.append({"role": "system", "content": system})
                msgs.append({"role": "user", "content": sessions[s][turn]})
                prompt = chat.tokens(msgs)
                if turn == 0:
                    firsts.append(prompt)
                r = chat.request(prompt)
                cold = chat.cold_ttft(prompt) if r["reused"] else None
                msgs.append({"role": "assistant", "content": r["reply"]})
                ratio = store.stats().dedup_ratio
                say(_row(f"session {s + 1} turn {turn + 1}", len(prompt), r, cold, ratio))
                if real:
                    _say_reply(say, sessions[s][turn], r)
        finally:
            chat.cache.close()
        st = store.stats()
        say(
            f"store: {st.entries} entries, {st.logical_bytes / 1024:.0f} KiB logical, "
            f"{st.physical_bytes / 1024:.0f} KiB on disk (dedup x{st.dedup_ratio:.2f})"
        )
        say(_shared_line(firsts, store.local.settings.block_tokens, st.dedup_ratio))


def _second_process(root: Path, model_dir: Path, say: Callable[[str], None],
                    real: bool = False) -> int:
    """A cold process: nothing in memory, the store's entries only."""
    with Store.open(root) as store:
        chat = _Chat(model_dir, store)
        try:
            prompt = chat.tokens(
                [
                    {"role": "system", "content": _system_prompt(real)},
                    {"role": "user", "content": SECOND_PROCESS_QUESTION},
                ]
            )
            r = chat.request(prompt)
            cold = chat.cold_ttft(prompt) if r["reused"] else None
        finally:
            chat.cache.close()
        say(_row("2nd process", len(prompt), r, cold, store.stats().dedup_ratio))
        if real:
            _say_reply(say, SECOND_PROCESS_QUESTION, r)
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


class DemoModelError(KVStoreError, ValueError):
    """``--model`` names neither a known model nor an mlx-lm model directory."""


def _real_model(model: str | None, say: Callable[[str], None]) -> Path | None:
    """The real model's directory for ``--model``, saying which and why; None for the tiny
    model (the default, whatever the model cache holds: it runs in seconds, offline)."""
    from kvstore.mlx_lm.gguf import MODELS, cached_model, fetch_model

    if model is None:
        hint = "'kvstore demo --model smollm2' runs a real model (minutes on a CPU)"
        if cached_model("smollm2") is not None:
            hint = ("smollm2 is already fetched: 'kvstore demo --model smollm2' runs it "
                    "(minutes on a CPU)")
        say("model: a tiny random-weight llama, built on the spot (the default: nothing is "
            f"downloaded and it takes seconds; its replies are noise). {hint}")
        return None
    if model in MODELS and not Path(model).exists():
        d = fetch_model(model, log=say)
        say(f"model: {model}, {MODELS[model].description} (--model {model}): {d}")
        return d
    path = Path(model).expanduser()
    known = ", ".join(sorted(MODELS))
    if not path.exists():
        raise DemoModelError(f"--model {model}: no such model directory (give {known} or an "
                             "mlx-lm model directory)")
    if not path.is_dir():
        raise DemoModelError(f"--model {model}: not a model directory")
    if not (path / "config.json").is_file():
        raise DemoModelError(f"--model {model}: not a model directory (no config.json)")
    say(f"model: {model} (--model)")
    return path


def _second(argv: list[str], quiet: bool) -> int:
    """Run the second process; Ctrl-C in the terminal reaches this process only.

    The child runs in a session of its own, so the terminal's SIGINT is not delivered
    to it (it would print a traceback of whatever it was importing): this process
    stops it and re-raises, and the command line prints one line."""
    proc = subprocess.Popen(argv, stdout=None if not quiet else subprocess.DEVNULL,
                            start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def demo_root() -> Path:
    """The demo's own root, when ``kvstore demo`` is not given ``--root``: beside the default
    root in the user cache dir (``kvstore-demo``), never the default root itself (the demo's
    tiny-model entries have no business among a user's)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstore-demo", appauthor=False))


def run_demo(root: str | Path, *, quiet: bool = False, model: str | None = None,
             own_root: bool = False) -> int:
    """Run the demo against the cache root `root`; 0 when the second process reused the cache.

    `model`: None (the tiny model), a known model name (``smollm2``) or an mlx-lm model
    directory. `own_root`: `root` is the demo's own (:func:`demo_root`, no ``--root``
    given); the demo says so, and at the end how to look at it and remove it.
    """
    say: Callable[[str], None] = (lambda s: None) if quiet else _print
    root = Path(root)
    where = f"cache root {root}"
    if own_root:
        where += " (the demo's own, not your default root; --root DIR chooses another)"
    code = _run_demo(root, say, where, quiet, model)
    if own_root:
        say(f"the demo's entries stay in {root}: 'kvstore --root {root} ls' (or tree) "
            f"shows them, 'rm -r {root}' removes them")
    return code


def _run_demo(root: Path, say: Callable[[str], None], where: str, quiet: bool,
              model: str | None) -> int:
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        real_dir = _real_model(model, say)
        real = real_dir is not None
        if real_dir is not None:
            model_dir = real_dir
            say(f"{where}; each request that reuses a prefix is also prefilled "
                "from nothing, to time it")
        else:
            model_dir = make_tiny_model(Path(tmp) / "tiny-llama", "llama")
            say(where)
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
        code = _second(argv, quiet)
        if code != 0:
            say("the second process did not reuse the cache")
        return code


def _print(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.demo``: the whole demo, or (``--second``) its second process."""
    p = argparse.ArgumentParser(prog="python -m kvstore.demo")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--second", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--real", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        if args.second:
            if args.model is None:
                p.error("--second needs --model")
            say: Callable[[str], None] = (lambda s: None) if args.quiet else _print
            return _second_process(args.root, args.model, say, args.real)
        return run_demo(args.root, quiet=args.quiet)
    except KeyboardInterrupt:
        print("kvstore demo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
