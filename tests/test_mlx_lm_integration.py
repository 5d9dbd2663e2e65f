"""PersistentPromptCache: LRUPromptCache's behaviour, plus a disk tier that survives."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from helpers.stores import SlowStore
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, LRUPromptCache, make_prompt_cache

import kvstore
from kvstore.mlx_lm import PersistentPromptCache, fingerprint_model, namespace_for_path
from kvstore.tiny import KINDS, make_tiny_model, sample_text

NO_DISK = 10**9  # min_tokens that keeps everything in memory


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: make_tiny_model(root / kind, kind) for kind in KINDS}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[kvstore.Store]:
    with kvstore.Store.open(tmp_path / "root", durable=False) as s:
        yield s


def _kv(tokens: list[int], seed: int = 0) -> list[Any]:
    """A two-layer KVCache whose keys/values are a function of the tokens."""
    layers = []
    for layer in range(2):
        c = KVCache()
        t = mx.array(tokens, dtype=mx.float32).reshape(1, 1, len(tokens), 1)
        k = mx.broadcast_to(t * (layer + 1) + seed, (1, 2, len(tokens), 8))
        c.update_and_fetch(k, -k)
        layers.append(c)
    mx.eval([c.state for c in layers])
    return layers


def _offsets(cache: list[Any] | None) -> list[int] | None:
    return None if cache is None else [c.offset for c in cache]


def _live(c: KVCache) -> tuple[mx.array, mx.array]:
    """The keys and values a KVCache holds (its buffers may have spare capacity)."""
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


def _same(a: list[Any], b: list[Any]) -> bool:
    return all(
        x.offset == y.offset
        and mx.array_equal(_live(x)[0], _live(y)[0]).item()
        and mx.array_equal(_live(x)[1], _live(y)[1]).item()
        for x, y in zip(a, b, strict=True)
    )


# --- parity with LRUPromptCache --------------------------------------------------


def _both(store: kvstore.Store, **kw: Any) -> tuple[LRUPromptCache, PersistentPromptCache]:
    return LRUPromptCache(**kw), PersistentPromptCache(store, min_tokens=NO_DISK, **kw)


def test_exact_shorter_and_longer_hits_match_lru(store: kvstore.Store) -> None:
    lru, ppc = _both(store)
    base = list(range(1, 41))
    for c in (lru, ppc):
        c.insert_cache("m", base, _kv(base))
    queries = [base, base + [99, 98], base[:25], base[:25] + [7, 7], base[:1], [5, 4, 3]]
    for q in queries:
        a, ra = lru.fetch_nearest_cache("m", q)
        b, rb = ppc.fetch_nearest_cache("m", q)
        assert ra == rb, q
        assert _offsets(a) == _offsets(b), q
        if a is not None:
            assert _same(a, b)
    # A longer trimmable entry serves a shorter query but leaves one token to process.
    cache, rest = ppc.fetch_nearest_cache("m", base[:25])
    assert rest == [base[24]] and _offsets(cache) == [24, 24]
    ppc.close()


def test_fetched_cache_is_an_independent_copy(store: kvstore.Store) -> None:
    ppc = PersistentPromptCache(store, min_tokens=NO_DISK)
    toks = list(range(10))
    ppc.insert_cache("m", toks, _kv(toks))
    a, _ = ppc.fetch_nearest_cache("m", toks + [1])
    a[0].update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    b, _ = ppc.fetch_nearest_cache("m", toks + [1])
    assert _offsets(b) == [10, 10]
    ppc.close()


@pytest.mark.parametrize("order", ["system-first", "assistant-first"])
def test_eviction_order_by_cache_type_matches_lru(store: kvstore.Store, order: str) -> None:
    lru, ppc = _both(store, max_size=3)
    types = ["system", "user", "assistant", "assistant", "user", "system", "assistant"]
    if order == "assistant-first":
        types.reverse()
    for i, ct in enumerate(types):
        toks = [1000 + i] + list(range(i + 2))
        for c in (lru, ppc):
            c.insert_cache("m", toks, _kv(toks), cache_type=ct)
        assert len(lru) == len(ppc)
        assert lru.nbytes == ppc.nbytes
        assert lru.stats_by_type() == ppc.stats_by_type()
    for i in range(len(types)):
        q = [1000 + i] + list(range(i + 2)) + [7]
        assert lru.fetch_nearest_cache("m", q)[1] == ppc.fetch_nearest_cache("m", q)[1]
    for c in (lru, ppc):
        c.trim_to(n_sequences=1)
    assert lru.stats_by_type() == ppc.stats_by_type() and len(ppc) == 1
    ppc.close()


def test_trimmable_insert_drops_its_prefixes_like_lru(store: kvstore.Store) -> None:
    lru, ppc = _both(store)
    for c in (lru, ppc):
        c.insert_cache("m", [1, 2, 3], _kv([1, 2, 3]))
        c.insert_cache("m", [1, 2, 3, 4, 5], _kv([1, 2, 3, 4, 5]))
    assert len(lru) == len(ppc) == 1 and lru.nbytes == ppc.nbytes
    ppc.close()


# --- the disk tier -----------------------------------------------------------------


def _key(models: dict[str, Path], kind: str = "llama") -> tuple[str, None, None]:
    return (str(models[kind]), None, None)


def test_store_answers_after_memory_eviction_and_restart(
    models: dict[str, Path], tmp_path: Path
) -> None:
    key = _key(models)
    toks = list(range(3, 603))
    original = _kv(toks)
    with kvstore.Store.open(tmp_path / "root") as store:
        ppc = PersistentPromptCache(store, max_size=1, min_tokens=16)
        ppc.insert_cache(key, toks, original)
        ppc.insert_cache(key, [9, 9, 9] * 10, _kv([9, 9, 9] * 10))  # evicts toks from memory
        assert ppc.drain(30)
        assert ppc.saved == 2 and ppc.failed == 0 and ppc.bytes_written > 0
        cache, rest = ppc.fetch_nearest_cache(key, toks + [1, 2])
        assert rest == [1, 2] and _same(cache, original)
        ppc.close()
    with kvstore.Store.open(tmp_path / "root") as store:  # a restart: nothing in memory
        ppc = PersistentPromptCache(store)
        cache, rest = ppc.fetch_nearest_cache(key, toks[:500] + [5])
        assert rest == [5] and _offsets(cache) == [500, 500]
        # The exact prompt: one token is always left to process.
        cache, rest = ppc.fetch_nearest_cache(key, toks)
        assert rest == toks[-1:] and _offsets(cache) == [599, 599]
        assert ppc.persist_stats().store_hits == 2
        ppc.close()


def test_second_process_hits_and_exit_flushes(models: dict[str, Path], tmp_path: Path) -> None:
    """A process that exits without draining still writes its queue; another one reads it."""
    script = textwrap.dedent(
        """
        import sys, mlx.core as mx, kvstore
        from mlx_lm.models.cache import KVCache
        from kvstore.mlx_lm import PersistentPromptCache
        root, model, mode = sys.argv[1:4]
        toks = list(range(7, 707))
        store = kvstore.Store.open(root)
        ppc = PersistentPromptCache(store, min_tokens=16)
        key = (model, None, None)
        if mode == "write":
            c = KVCache()
            k = (mx.arange(2 * 700 * 8) % 97).astype(mx.float32).reshape(1, 2, 700, 8)
            c.update_and_fetch(k, k + 1)
            ppc.insert_cache(key, toks, [c])
            print("queued")  # and exit at once: the exit hook must flush
        else:
            cache, rest = ppc.fetch_nearest_cache(key, toks + [1])
            c = cache[0]
            k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            print(len(rest), cache[0].offset, k.sum().item(), v.sum().item())
        """
    )
    root, model = str(tmp_path / "root"), str(models["llama"])

    def run(mode: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", script, root, model, mode],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().splitlines()[-1]

    assert run("write") == "queued"
    total = float(sum(i % 97 for i in range(2 * 700 * 8)))
    assert run("read") == f"1 700 {total} {total + 2 * 700 * 8}"


def test_models_never_exchange_caches(
    models: dict[str, Path], tmp_path: Path, store: kvstore.Store
) -> None:
    other = make_tiny_model(tmp_path / "other", "llama", seed=1)
    toks = list(range(300))
    ppc = PersistentPromptCache(store, min_tokens=16)
    ppc.insert_cache(_key(models), toks, _kv(toks))
    assert ppc.drain(30) and ppc.saved == 1
    fresh = PersistentPromptCache(store)
    assert fresh.fetch_nearest_cache((str(other), None, None), toks + [1]) == (None, toks + [1])
    # The same directory, rewritten with other weights, is another model too.
    changed = shutil.copytree(models["llama"], tmp_path / "changed")
    ns_before = namespace_for_path(changed)
    ppc.insert_cache((str(changed), None, None), toks, _kv(toks))
    assert ppc.drain(30)
    make_tiny_model(changed, "llama", seed=2)
    assert namespace_for_path(changed) != ns_before
    again = PersistentPromptCache(store)
    assert again.fetch_nearest_cache((str(changed), None, None), toks + [1])[0] is None
    for c in (ppc, fresh, again):
        c.close()


def test_register_model_object_and_unknown_keys(
    models: dict[str, Path], store: kvstore.Store
) -> None:
    model, _ = mlx_lm.load(str(models["llama"]))
    ppc = PersistentPromptCache(store, min_tokens=16)
    ns = ppc.register_model("chat", model)
    assert ns.config_fingerprint == fingerprint_model(model)
    toks = list(range(50))
    ppc.insert_cache("chat", toks, _kv(toks))
    ppc.insert_cache("not-a-model", toks, _kv(toks))  # no fingerprint: memory only
    assert ppc.drain(30)
    assert ppc.saved == 1 and ppc.persist_stats().skipped == 1
    ppc.close()


def test_short_prompts_are_not_persisted(models: dict[str, Path], store: kvstore.Store) -> None:
    ppc = PersistentPromptCache(store, min_tokens=64)
    ppc.insert_cache(_key(models), list(range(63)), _kv(list(range(63))))
    assert ppc.drain(10)
    assert ppc.saved == 0 and ppc.persist_stats().skipped == 1
    assert list(store.entries()) == []
    ppc.close()


def test_queue_sheds_oldest_over_its_byte_cap(
    models: dict[str, Path], store: kvstore.Store
) -> None:
    slow = SlowStore(store)
    one = sum(c.nbytes for c in _kv(list(range(100))))
    # every snapshot queued at once (100 tokens hold no whole block of this root: by
    # default they would wait in memory, see test_prompt_cache_requests.py)
    ppc = PersistentPromptCache(slow, min_tokens=16, queue_bytes=int(2.5 * one),  # type: ignore[arg-type]
                                defer_seconds=0)
    for i in range(5):
        toks = [i] + list(range(99))
        ppc.insert_cache(_key(models), toks, _kv(toks))
        if i == 0:  # the worker holds the first before the others come
            assert slow.entered.wait(30)
    # One snapshot is in the worker's hands, two fit the queue; the oldest are shed.
    assert ppc.dropped == 2 and ppc.pending == 3
    slow.gate.set()
    assert ppc.drain(30)
    assert ppc.saved == 3 and ppc.pending == 0
    saved_first = {e.n_tokens for e in store.entries()}
    assert saved_first == {100}
    ppc.close()


def test_failed_background_save_is_counted_and_generation_goes_on(
    models: dict[str, Path], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    model, tokenizer = mlx_lm.load(str(models["llama"]))
    prompt = tokenizer.encode(sample_text(300))
    with kvstore.Store.open(root) as store:
        # A real failure: blocks/ is no longer a directory, so no block can be written.
        shutil.rmtree(root / "blocks")
        (root / "blocks").write_bytes(b"")
        ppc = PersistentPromptCache(store, min_tokens=16)
        key = _key(models)
        for _ in range(2):
            cache, rest = ppc.fetch_nearest_cache(key, prompt)
            cache = cache or make_prompt_cache(model)
            out = [
                t for t, _ in generate_step(mx.array(rest), model, prompt_cache=cache, max_tokens=4)
            ]
            assert len(out) == 4
            ppc.insert_cache(key, prompt + out, cache)
            assert ppc.drain(30)
        assert ppc.failed == 2 and ppc.saved == 0
        assert ppc.persist_stats().memory_hits == 1  # the memory tier still serves
        ppc.close()


# --- generation is unchanged by the store -------------------------------------------


def _greedy(model: Any, cache: list[Any], rest: list[int], n: int = 8) -> tuple[list[int], Any]:
    tokens, logprobs = [], []
    for t, lp in generate_step(mx.array(rest), model, prompt_cache=cache, max_tokens=n):
        tokens.append(t)
        logprobs.append(lp)
    return tokens, mx.stack(logprobs)


@pytest.mark.parametrize("kind", KINDS)
def test_generation_with_store_equals_without(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    model, tokenizer = mlx_lm.load(str(models[kind]))
    system = tokenizer.apply_chat_template(
        [{"role": "system", "content": sample_text(420, seed=1)}], tokenize=True
    )
    user = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What colour is the sky?"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(system) + list(user)
    assert len(system) > 400  # past gemma3_text's sliding window: the ring has wrapped
    key = _key(models, kind)

    # Like mlx-lm's server, save the state after the system segment.
    def prefill_system() -> list[Any]:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(system)[None], cache=cache))
        return cache

    with kvstore.Store.open(tmp_path / "root") as store:
        writer = PersistentPromptCache(store, min_tokens=16)
        writer.insert_cache(key, list(system), prefill_system(), cache_type="system")
        assert writer.drain(30) and writer.saved == 1
        writer.close()

        reader = PersistentPromptCache(store)  # cold memory: the store must answer
        cache, rest = reader.fetch_nearest_cache(key, prompt)
        assert cache is not None and len(prompt) - len(rest) == len(system)
        with_store = _greedy(model, cache, rest)
        reader.close()

    lru = LRUPromptCache()
    lru.insert_cache(key, list(system), prefill_system(), cache_type="system")
    cache, rest = lru.fetch_nearest_cache(key, prompt)
    in_memory = _greedy(model, cache, rest)
    without = _greedy(model, make_prompt_cache(model), prompt)

    assert with_store[0] == in_memory[0] == without[0]
    # Same split of the prompt: bit-identical logits.
    assert mx.array_equal(with_store[1], in_memory[1]).item()
    assert mx.allclose(with_store[1], without[1], atol=1e-3).item()


def test_insert_saves_only_the_tokens_the_cache_holds(
    models: dict[str, Path], store: kvstore.Store
) -> None:
    toks = list(range(100))
    ppc = PersistentPromptCache(store, min_tokens=16)
    ppc.insert_cache(_key(models), toks + [555], _kv(toks))  # one token not yet processed
    assert ppc.drain(30) and ppc.failed == 0
    assert [e.n_tokens for e in store.entries()] == [100]
    ppc.close()


@pytest.mark.parametrize("reuse", [True, False])
def test_next_turn_references_the_stored_prefix_blocks(
    models: dict[str, Path], store: kvstore.Store, monkeypatch: pytest.MonkeyPatch, reuse: bool
) -> None:
    import kvstore.local.writer as W

    T = store.block_tokens
    turn1 = list(range(2 * T + 40))
    turn2 = turn1 + list(range(5000, 5000 + T))
    ppc = PersistentPromptCache(store, min_tokens=16, reuse_prefix=reuse)
    ppc.insert_cache(_key(models), turn1, _kv(turn1))
    assert ppc.drain(30) and ppc.saved == 1
    hashed: list[str] = []
    real = W.new_hasher

    def counting(algo: str) -> object:
        hashed.append(algo)
        return real(algo)

    monkeypatch.setattr(W, "new_hasher", counting)
    c2 = _kv(turn2)  # the next turn: turn1's rows, then new ones
    ppc.insert_cache(_key(models), turn2, c2)
    assert ppc.drain(30) and ppc.saved == 2 and ppc.failed == 0
    by_len = {e.n_tokens: store.manifest(e.id) for e in store.entries()}
    m1, m2 = by_len[len(turn1)], by_len[len(turn2)]
    assert m2.token_blocks[:2] == m1.token_blocks[:2]  # the same bytes, stored once
    skipped = 2 if reuse else 0
    assert len(hashed) == len(m2.token_blocks) + len(m2.state_blocks) - skipped
    restored, n = store.restore(turn2, namespace=ppc.namespace_for(_key(models)))
    assert n == len(turn2) and _same(restored, c2)
    ppc.close()
