"""Checkpoints during prefill (issue 26): a shared document, hybrid and sliding-window
models against llama, checkpoints on against off; and the bytes on disk per checkpoint.

Each kind gets two roots that go through the same requests as ``kvstore serve`` makes
them: the system prompt's state saved at its end, then question 1 (system prompt,
document, question) restored from the deepest stored prefix, prefilled and saved at its
end; with checkpoints on, :func:`kvstore.mlx_lm.prefill` also saves one every
``ckpt_every`` tokens on the way. Then the timed question 2 (same document, another
question): restore the deepest stored prefix, prefill the rest (saving any checkpoint it
passes), one step. Its first token must equal that of a cold prefill of the whole prompt.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..codecs.layout import geometry, in_token_blocks, in_window_blocks
from ..schema import Manifest, Namespace
from ..store import Store
from .common import Config, Row, interleave, median

__all__ = ["checkpoint_rows", "checkpoint_bytes"]

SYSTEM = 384  # tokens of the system prompt (what a root without checkpoints restores)
QUESTION = 24  # tokens of each question


def _model(cfg: Config, scratch: Path, kind: str) -> Any:
    from mlx_lm import load

    from ..tiny import make_tiny_model

    path = make_tiny_model(scratch / f"tiny-{kind}", kind=kind, hidden_size=cfg.model_hidden,
                           num_layers=cfg.ckpt_layers, dtype="float32",
                           sliding_window=cfg.ckpt_window)
    return load(str(path))[0]


def _vocab(model: Any) -> int:
    args = getattr(model.args, "text_config", None) or vars(model.args)
    return int(args["vocab_size"])


def _first_token(model: Any, cache: list[Any], rest: list[int]) -> int:
    logits = model(mx.array(rest)[None], cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)
    first: Any = y.tolist()  # mlx's stubs do not say it is a list of ints here
    return int(first[0])


class _Side:
    """One root going through the requests, checkpoints on (``every``) or off (0)."""

    def __init__(self, model: Any, root: Path, ns: Namespace, every: int) -> None:
        self.model, self.every = model, every
        self.store = Store.open(root, namespace=ns, durable=True)

    def request(self, prompt: list[int]) -> tuple[int, int, float]:
        """Serve one prompt as ``kvstore serve`` does: (cached tokens, first token, seconds
        to it). The state before the last token is saved after that, as serve's
        write-behind does."""
        from ..mlx_lm.prefill import prefill

        head = prompt[:-1]
        t = time.perf_counter()
        cache, n = self.store.restore(head)
        done = prefill(self.model, head, cache, store=self.store, every=self.every,
                       save_end=False)  # saved below, after the first token, as serve does
        snapshot = copy.deepcopy(done.cache)
        first = _first_token(self.model, done.cache, prompt[-1:])
        dt = time.perf_counter() - t
        if n < len(head):
            self.store.save(head, snapshot, priority="user", reuse_prefix=True)
        return n, first, dt

    def close(self) -> None:
        self.store.close()


def checkpoint_bytes(ms: list[Manifest], sizes: dict[bytes, int], every: int
                     ) -> dict[str, float]:
    """The bytes each checkpoint adds beyond the ones before it, averaged over all but the
    first (which has nothing to share with): ``new`` in all, ``kv`` its new tokens'
    key/value rows (every cache stores those), ``state`` its SSM/convolution state,
    ``edge`` one window block (the bound on a sliding window's partial first block),
    ``whole`` its own logical bytes (storing it whole)."""
    seen: set[bytes] = set()
    acc = {"new": 0.0, "kv": 0.0, "state": 0.0, "edge": 0.0, "whole": 0.0, "beyond_kv": 0.0}
    counted = 0
    for m in sorted(ms, key=lambda m: m.n_tokens):
        blocks = set(m.all_blocks())
        if seen:
            specs = m.tensor_specs()

            def rows(which: Any, specs: list[Any] = specs) -> int:
                return sum(geometry(s.shape, s.dtype, s.token_axis).outer
                           * geometry(s.shape, s.dtype, s.token_axis).row_bytes
                           for s in specs if which(s))

            new = sum(sizes[d] for d in blocks - seen)
            kv = every * (rows(in_token_blocks) + rows(in_window_blocks))
            acc["new"] += new
            acc["kv"] += kv
            acc["beyond_kv"] += max(new - kv, 0)
            acc["state"] += m.state_bytes
            acc["edge"] += m.block_tokens * rows(in_window_blocks)
            acc["whole"] += sum(sizes[d] for d in m.all_blocks())
            counted += 1
        seen |= blocks
    return {k: v / counted for k, v in acc.items()} if counted else {}


def checkpoint_rows(cfg: Config, scratch: Path, log: Any = print) -> list[Row]:
    """For each kind of ``cfg.ckpt_kinds``: question 2's cached tokens and time to first
    token with checkpoints on vs off; for the kinds that get checkpoints, the bytes on
    disk per checkpoint vs storing it whole, and the root's bytes on vs off."""
    rows: list[Row] = []
    for kind in cfg.ckpt_kinds:
        log(f"[checkpoints] {kind}: document {cfg.ckpt_doc} tokens, every {cfg.ckpt_every}")
        rows.extend(_kind_rows(cfg, scratch, kind))
    return rows


def _kind_rows(cfg: Config, scratch: Path, kind: str) -> list[Row]:
    from mlx_lm.models.cache import make_prompt_cache

    from ..mlx_lm.prefill import needs_checkpoints

    model = _model(cfg, scratch, kind)
    rng = np.random.default_rng(26)
    vocab = _vocab(model)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(8, vocab, n)]

    system, doc = tokens(SYSTEM), tokens(cfg.ckpt_doc)
    questions = [tokens(QUESTION) for _ in range(cfg.ckpt_reps + 2)]
    ns = Namespace(model_id=f"kvstore-bench-{kind}")
    base = Path(tempfile.mkdtemp(prefix=f"ckpt-{kind}-", dir=scratch))
    sides = {"on": _Side(model, base / "on", ns, cfg.ckpt_every),
             "off": _Side(model, base / "off", ns, 0)}
    try:
        for side in sides.values():  # the system prompt's state, as serve saves it
            cache = make_prompt_cache(model)
            model(mx.array(system)[None], cache=cache)
            mx.eval([c.state for c in cache])
            side.store.save(system, cache, priority="system")
            side.request(system + doc + questions[0])  # question 1
        # what question 1 left on disk, before question 2's prefills add to it
        on = sides["on"].store
        ckpts = [e for e in on.entries() if e.priority == "checkpoint"]
        ms = list(on.views.manifests([e.id for e in ckpts]).values())
        sizes = {d: s for m in ms for d, (s, _) in on.views.block_refs(m.all_blocks()).items()}
        per = checkpoint_bytes(ms, sizes, cfg.ckpt_every)
        physical = {k: float(s.store.stats().physical_bytes) for k, s in sides.items()}
        cached: dict[str, list[int]] = {"on": [], "off": []}
        queues = {name: iter(questions[1:]) for name in sides}  # the same questions each

        def ask(name: str) -> float:
            prompt = system + doc + next(queues[name])
            want = _cold(model, prompt)
            n, first, dt = sides[name].request(prompt)
            assert first == want, f"{kind}: the restored state gave another token"
            cached[name].append(n)
            return dt

        res = interleave({"on": lambda: ask("on"), "off": lambda: ask("off")}, cfg.ckpt_reps)
    finally:
        for s in sides.values():
            s.close()
        shutil.rmtree(base, ignore_errors=True)
    label = f"{kind}, {cfg.ckpt_doc}-token document, every {cfg.ckpt_every}"
    on_n, off_n = median(cached["on"]), median(cached["off"])
    extra = {"document_tokens": float(cfg.ckpt_doc), "every": float(cfg.ckpt_every),
             "system_tokens": float(SYSTEM), "prompt_tokens": float(SYSTEM + cfg.ckpt_doc
                                                                     + QUESTION)}
    out = [
        Row("checkpoints", f"shared document, question 2: cached tokens ({label})", "tokens",
            on_n, off_n, "checkpoints off", "throughput", extra=dict(extra)),
        Row("checkpoints", f"shared document, question 2: time to first token ({label})", "s",
            median(res["on"]), median(res["off"]), "checkpoints off", "speedup",
            extra=dict(extra)),
    ]
    if needs_checkpoints(make_prompt_cache(model)) and per:
        out.append(Row("checkpoints", f"bytes on disk per checkpoint ({label})", "B",
                       per["new"], per["whole"], "the checkpoint stored whole", "fraction",
                       extra={**extra, **{f"mean_{k}": v for k, v in per.items()},
                              "checkpoints": float(len(ms))}))
        out.append(Row("checkpoints", f"root after question 1: bytes on disk ({label})", "B",
                       physical["on"], physical["off"], "checkpoints off", "fraction",
                       extra=dict(extra)))
    return out


def _cold(model: Any, prompt: list[int]) -> int:
    """The first token of a cold prefill of the whole prompt (one chunk of at most 2048)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    pos = 0
    while len(prompt) - pos > 2048:
        model(mx.array(prompt[pos : pos + 2048])[None], cache=cache)
        mx.eval([c.state for c in cache])
        pos += 2048
    return _first_token(model, cache, prompt[pos:])
