"""``kvstore.mlx_lm.prefill``: checkpoints during prefill (issue 26), on tiny random-weight
models of every cache kind: what is saved where, and that the state restored from each
checkpoint is bit for bit the state the prefill had at that token."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

import kvstore
from kvstore.mlx_lm import needs_checkpoints, prefill
from kvstore.mlx_lm.prefill import (
    MIN_EVERY,
    checkpoint_costs,
    checkpoint_positions,
    default_every,
    split_segments,
)
from kvstore.tiny import KINDS, make_tiny_model

NS = kvstore.Namespace(model_id="prefill")
T = 32
EVERY = 2 * T
HYBRIDS = [k for k in KINDS if k != "llama"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    # a 48-token window: the rings wrap well before the first checkpoint
    return {k: make_tiny_model(base / k, k, sliding_window=48) for k in KINDS}


def _prompt(n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 700) for _ in range(n)]


def _bits(v: mx.array) -> tuple[Any, ...]:
    mx.eval(v)
    return (v.dtype, tuple(v.shape), bytes(memoryview(v)))


def _state(cache: list[Any]) -> list[tuple[str, Any]]:
    """Everything a cache's next step reads, bit for bit: a KV layer's live rows (a spare
    capacity is an allocation, never read), a ring's whole buffer (its layout is what the
    next step writes into), SSM and convolution states whole, and the layers' counters."""
    out: list[tuple[str, Any]] = []
    layers = [(f"{i}.{j}", x) for i, c in enumerate(cache)
              for j, x in enumerate(c.caches if isinstance(c, CacheList) else (c,))]
    for path, layer in layers:
        if type(layer) is KVCache:
            arrays = dict(enumerate(layer.keys_and_values()))
        else:
            arrays = {name: v for name, v in tree_flatten(layer.state) if isinstance(v, mx.array)}
        out += [(f"{path}.{name}", _bits(v)) for name, v in arrays.items()]
        for attr in ("offset", "_idx", "max_size", "keep"):
            if hasattr(layer, attr):
                out.append((f"{path}.{type(layer).__name__}.{attr}", getattr(layer, attr)))
    return out


def test_checkpoint_positions_and_segments() -> None:
    assert checkpoint_positions(0, 200, 64) == [64, 128, 192]
    assert checkpoint_positions(64, 128, 64) == [128]
    assert checkpoint_positions(65, 127, 64) == []
    assert checkpoint_positions(0, 200, 0) == []
    segs, kinds = split_segments([list(range(10)), list(range(10, 150))], ["system", "user"],
                                 0, 64)
    assert [len(s) for s in segs] == [10, 54, 64, 22]
    assert kinds == ["system", "checkpoint", "checkpoint", "user"]
    assert sum(segs, []) == list(range(150))
    # a cut at a segment's own end adds nothing; positions are absolute
    segs, kinds = split_segments([list(range(28))], ["user"], 100, 64)
    assert [len(s) for s in segs] == [28] and kinds == ["user"]
    segs, kinds = split_segments([list(range(30))], ["user"], 100, 64)
    assert [len(s) for s in segs] == [28, 2] and kinds == ["checkpoint", "user"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_checkpoint_restores_the_very_state_of_the_prefill(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    model, _ = mlx_lm.load(str(models[kind]))
    prompt = _prompt(5 * EVERY + 37)
    seen: dict[int, list[tuple[str, Any]]] = {}
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=T) as store:
        done = prefill(model, prompt, store=store, every=EVERY, step=48,
                       on_checkpoint=lambda pos, cache: seen.__setitem__(pos, _state(cache)))
        assert needs_checkpoints(done.cache) is (kind != "llama")
        assert done.end is not None and done.end.n_tokens == len(prompt)
        if kind == "llama":  # trimmable: the prompt's end serves every prefix
            assert done.checkpoints == [] and not seen
            assert [e.id for e in store.entries()] == [done.end.id]
            return
        assert sorted(seen) == [EVERY * k for k in range(1, 6)]
        assert [c.n_tokens for c in done.checkpoints] == sorted(seen) and done.failed == 0
        entries = {e.id: e for e in store.entries()}
        for info in done.checkpoints:
            e = entries[info.id]
            assert e.priority == "checkpoint"
            meta = store.manifest(info.id).metadata
            assert meta["cache_type"] == "checkpoint" and meta["prompt_tokens"] == "357"
            # the lookup finds it as the deepest state at or before a divergence
            query = prompt[: info.n_tokens] + _prompt(20, 9)
            match = store.lookup(query)
            assert match is not None and (match.entry_id, match.length) == (info.id, info.n_tokens)
            restored = store.load(match)
            assert _state(restored) == seen[info.n_tokens], f"checkpoint {info.n_tokens}"


@pytest.mark.parametrize("kind", HYBRIDS)
def test_continuing_from_a_checkpoint_is_continuing_from_memory(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """Greedy tokens after restoring a checkpoint are those of mlx-lm's own in-memory
    prompt cache at that token (the state is the same bits: the contract), and on these
    models also those of a cold prefill of the whole prompt in one chunk (which could
    differ from both in the last bits, as mlx-lm's own prompt cache could)."""
    model, _ = mlx_lm.load(str(models[kind]))
    doc = _prompt(3 * EVERY + 5)
    question = _prompt(30, 4)
    kept: dict[int, list[Any]] = {}
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=T) as store:
        prefill(model, doc, store=store, every=EVERY, save_end=False,  # the checkpoint's
                on_checkpoint=lambda pos, cache: kept.__setitem__(pos, copy.deepcopy(cache)))
        cache, n = store.restore(doc + question)
    assert n == 3 * EVERY

    def greedy(c: list[Any], rest: list[int]) -> list[int]:
        return [t for t, _ in generate_step(mx.array(rest), model, prompt_cache=c,
                                            max_tokens=12)]

    rest = (doc + question)[n:]
    from_store = greedy(cache, rest)
    assert from_store == greedy(kept[n], rest)
    assert greedy(make_prompt_cache(model), doc + question) == from_store


def test_every_zero_and_the_default_interval(models: dict[str, Path], tmp_path: Path) -> None:
    model, _ = mlx_lm.load(str(models["lfm2"]))
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=T) as store:
        assert prefill(model, _prompt(3 * EVERY), store=store, every=0).checkpoints == []
        done = prefill(model, _prompt(2100, 1), store=store)  # DEFAULT_EVERY, 32-token blocks
        assert [c.n_tokens for c in done.checkpoints] == [1024, 2048]
    with kvstore.Store.open(tmp_path / "r2", namespace=NS, block_tokens=384) as store:
        done = prefill(model, _prompt(2400, 2), store=store)  # rounded up to 3 blocks
        assert [c.n_tokens for c in done.checkpoints] == [1152, 2304]


@pytest.mark.parametrize("kind", ["llama", "lfm2"])
def test_the_same_prompt_twice_restores_all_of_it(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """Issue 38, item 11: prefill leaves the prompt's end stored, as serve does (it stored
    only checkpoints: the second time restored the deepest, 2 * EVERY of 2 * EVERY + 45)."""
    model, _ = mlx_lm.load(str(models[kind]))
    prompt = _prompt(2 * EVERY + 45, 7)
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=T) as store:
        cache, n = store.restore(prompt)
        assert n == 0
        first = prefill(model, prompt, cache, store=store, every=EVERY)
        assert [c.n_tokens for c in first.checkpoints] == ([] if kind == "llama"
                                                           else [EVERY, 2 * EVERY])
        assert first.end is not None and first.end.n_tokens == len(prompt)
        assert {e.id: e.priority for e in store.entries()}[first.end.id] == "user"
        cache, n = store.restore(prompt)
        assert n == len(prompt)
        again = prefill(model, prompt, cache, store=store, every=EVERY)
        assert (again.checkpoints, again.end, again.failed) == ([], None, 0)  # nothing new
        assert _state(again.cache) == _state(first.cache)
        # and save_end=False keeps the old behaviour: checkpoints only
        other = _prompt(2 * EVERY + 45, 8)
        assert prefill(model, other, store=store, every=EVERY, save_end=False).end is None
        assert store.restore(other)[1] == (0 if kind == "llama" else 2 * EVERY)


def test_prefill_from_a_restored_cache_and_a_failed_save(
    models: dict[str, Path], tmp_path: Path
) -> None:
    model, _ = mlx_lm.load(str(models["qwen3_5"]))
    prompt = _prompt(4 * EVERY + 3, 5)
    root = tmp_path / "root"
    with kvstore.Store.open(root, namespace=NS, block_tokens=T) as store:
        first = prefill(model, prompt[: 2 * EVERY + 10], store=store, every=EVERY,
                        save_end=False)
        assert [c.n_tokens for c in first.checkpoints] == [EVERY, 2 * EVERY]
        cache, n = store.restore(prompt)
        assert n == 2 * EVERY
        more = prefill(model, prompt, cache, store=store, every=EVERY)  # start from offsets
        assert [c.n_tokens for c in more.checkpoints] == [3 * EVERY, 4 * EVERY]
        with pytest.raises(ValueError, match="start"):
            prefill(model, prompt, [c for c in cache if not hasattr(c, "offset")],
                    store=store, every=EVERY)
    with kvstore.Store.open(root, read_only=True) as ro:
        done = prefill(model, prompt, store=ro, namespace=NS, every=EVERY)
        assert done.checkpoints == [] and done.end is None and done.failed == 5  # 4 and the end
        assert done.cache[-1].offset == len(prompt)


def test_readme_prefill_example_runs_offline(tmp_path: Path) -> None:
    """The README's checkpoint example, as written: the second question restores the
    deepest checkpoint the first one's prefill saved before the document's end."""
    import os
    import re
    import subprocess
    import sys

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    (code,) = [b for b in blocks if "from kvstore.mlx_lm import prefill" in b]
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_ROOT"}
    env.update(KVSTORE_ROOT=str(tmp_path / "root"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    p = subprocess.run([sys.executable, "-P", str(script)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = re.findall(r"^(\d+) of (\d+) prompt tokens came from the store; (\d+) checkpoints",
                       p.stdout, re.M)
    (n1, len1, saved1), (n2, len2, saved2) = [tuple(map(int, x)) for x in lines]
    assert (n1, saved1) == (0, len1 // 1024)
    assert n2 == len2 // 1024 * 1024 > 0 and saved2 == 0


class _Fake:
    """A model of two layers whose cache is what the test gives; a call adds its rows."""

    def __init__(self, layers: list[Any], state: int, kv_dim: int = 8) -> None:
        self.layers, self.state, self.kv_dim = layers, state, kv_dim

    def make_cache(self) -> list[Any]:
        return [type(x)(**a) for x, a in self.layers]

    def __call__(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        n = tokens.shape[1]
        for c in cache:
            if isinstance(c, ArraysCache):
                c[0] = mx.zeros((1, self.state // 4), dtype=mx.float32)
            else:
                kv = mx.zeros((1, 1, n, self.kv_dim), dtype=mx.float32)
                c.update_and_fetch(kv, kv)
        return mx.zeros((1, n, 4))


def test_checkpoint_costs_and_the_default_interval() -> None:
    kv: tuple[Any, dict[str, Any]] = (KVCache(), {})
    ring = (RotatingKVCache(max_size=512), {"max_size": 512})
    ssm = (ArraysCache(1), {"size": 1})
    # one KV layer of 1 head x 8 dims in float32: 64 bytes a token (keys and values)
    hybrid = _Fake([kv, ssm], state=1 << 20)
    cache = hybrid.make_cache()
    hybrid(mx.array([[1, 2]]), cache)
    assert checkpoint_costs(cache) == (64, 0, 1 << 20)
    # 1 MiB of state is a quarter of the rows of 65,536 tokens
    assert default_every(hybrid, 256) == 65536
    assert default_every(_Fake([kv, ssm], state=4096), 256) == MIN_EVERY  # small state
    assert default_every(_Fake([kv, ssm], state=4096), 384) == 1152  # whole blocks
    # a sliding window: one partial block of its rows per checkpoint
    window = _Fake([kv, ring], state=0)
    cache = window.make_cache()
    window(mx.array([[1, 2]]), cache)
    assert checkpoint_costs(cache) == (64, 64, 0)
    assert default_every(window, 256) == 1024  # 256 * 64 <= 0.25 * 1024 * 128
    assert default_every(window, 1024) == 2048  # 1024 * 64 > 0.25 * 1024 * 128
    assert default_every(_Fake([kv, kv], state=0), 256) == MIN_EVERY  # needs none anyway
