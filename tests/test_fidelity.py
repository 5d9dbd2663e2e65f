"""Fidelity with real models: restored caches decode to bit-identical logits.

Tiny random-weight models from mlx-lm's own classes (llama: KVCache;
gemma3_text: RotatingKVCache sliding layers; lfm2: ArraysCache conv layers).
The reference never leaves memory; the other side restores from the store in
a fresh process.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import kvstore
from kvstore.tiny import KINDS, make_tiny_model

NS = kvstore.Namespace(model_id="fidelity")
PROMPT = 300  # tokens: more than one 256-token block, and past the 128-token window
DECODE = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    return {
        kind: make_tiny_model(base / kind, kind, seed=3, sliding_window=128, dtype="bfloat16")
        for kind in KINDS
    }


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


def _decode(model: object, cache: list[object], tokens: list[int]) -> mx.array:
    """Feed ``tokens`` one at a time; the stacked logits of every step."""
    out = []
    for t in tokens:
        logits = model(mx.array([[t]]), cache=cache)  # type: ignore[operator]
        mx.eval(logits)
        out.append(logits[0, -1])
    return mx.stack(out)


def _bits(a: mx.array) -> bytes:
    mx.eval(a)
    return bytes(memoryview(a))


CHILD = textwrap.dedent(
    """
    import sys, mlx.core as mx, mlx_lm, kvstore
    model_dir, root, out = sys.argv[1:4]
    prompt = [int(x) for x in sys.argv[4].split(",")]
    feed = [int(x) for x in sys.argv[5].split(",")]
    model, _ = mlx_lm.load(model_dir)
    with kvstore.Store.open(root, namespace=kvstore.Namespace(model_id="fidelity")) as s:
        cache, n = s.restore(prompt)
    assert n == len(prompt), (n, len(prompt))
    logits = []
    for t in feed:
        l = model(mx.array([[t]]), cache=cache)
        mx.eval(l)
        logits.append(l[0, -1])
    mx.save_safetensors(out, {"logits": mx.stack(logits)})
    """
)


@pytest.mark.parametrize("kind", KINDS)
def test_restore_in_a_new_process_decodes_bit_identically(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    model, _ = mlx_lm.load(str(models[kind]))
    prompt = _prompt(PROMPT, 1)
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    mx.eval(logits)
    root = tmp_path / "root"
    with kvstore.Store.open(root, namespace=NS) as store:
        info = store.save(prompt, cache)
    assert info.n_tokens == PROMPT
    feed = [int(mx.argmax(logits[0, -1]).item())] + _prompt(DECODE - 1, 2)
    expect = _decode(model, cache, feed)
    out = tmp_path / "child.safetensors"
    subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(models[kind]),
            str(root),
            str(out),
            ",".join(map(str, prompt)),
            ",".join(map(str, feed)),
        ],
        check=True,
    )
    got = mx.load(str(out))["logits"]
    assert got.shape == expect.shape and got.dtype == expect.dtype
    assert _bits(got) == _bits(expect)


def test_partial_reuse_matches_trimming_in_memory(models: dict[str, Path], tmp_path: Path) -> None:
    """Restore a trimmed prefix, prefill the rest: the same logits as trimming in memory."""
    model, _ = mlx_lm.load(str(models["llama"]))
    a = _prompt(400, 5)
    b = a[:290] + _prompt(60, 6)  # shares 290 tokens: one full block and part of the next
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([a]), cache=cache))
    with kvstore.Store.open(tmp_path / "root", namespace=NS) as store:
        store.save(a, cache)
        restored, n = store.restore(b)
    assert n == 290
    ref = copy.deepcopy(cache)
    trim_prompt_cache(ref, len(a) - 290)
    want = model(mx.array([b[290:]]), cache=ref)
    got = model(mx.array([b[290:]]), cache=restored)
    assert _bits(got) == _bits(want)
    feed = _prompt(4, 7)
    assert _bits(_decode(model, restored, feed)) == _bits(_decode(model, ref, feed))


def test_generation_with_restored_cache_is_identical(
    models: dict[str, Path], tmp_path: Path
) -> None:
    model, tok = mlx_lm.load(str(models["gemma3_text"]))
    prompt = _prompt(100, 9)  # shorter than the window: the ring has not wrapped
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt[:-1]]), cache=cache))
    with kvstore.Store.open(tmp_path / "root", namespace=NS) as store:
        store.save(prompt[:-1], cache)
        restored, n = store.restore(prompt)
    assert n == 99
    fresh = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=12)
    again = mlx_lm.generate(model, tok, prompt=prompt[-1:], max_tokens=12, prompt_cache=restored)
    assert again == fresh
