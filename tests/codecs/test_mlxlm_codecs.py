"""The shared suite every mlx-lm codec passes: bit-exact round trips through a real root."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from factories import (
    arrays_cache,
    cache_list,
    chunked_cache,
    kv_cache,
    prefilled_rotating_cache,
    quantized_cache,
    rotating_cache,
    same_bits,
    state_arrays,
)
from mlx_lm.models import cache as C

import kvstore

NS = kvstore.Namespace(model_id="codec-suite")

# name -> (builder of a layer list for n tokens, n)
CASES: dict[str, tuple[Any, int]] = {
    "kv-bf16": (lambda n: [kv_cache(n, 1), kv_cache(n, 2)], 70),
    "kv-fp16": (lambda n: [kv_cache(n, 3, mx.float16)], 70),
    "kv-fp32": (lambda n: [kv_cache(n, 4, mx.float32, chunks=3)], 70),
    "kv-exact-block": (lambda n: [kv_cache(n, 5)], 64),
    "quantized-4bit": (lambda n: [quantized_cache(n, 6, bits=4)], 50),
    "quantized-8bit": (lambda n: [quantized_cache(n, 7, bits=8)], 50),
    "rotating-before-wrap": (lambda n: [rotating_cache(n, 64, 8)], 40),
    "rotating-after-wrap": (lambda n: [rotating_cache(n, 32, 9, keep=4)], 75),
    # keep=0 rings are stored unrolled in token order (window blocks), rolled back on restore
    "window-after-wrap": (lambda n: [rotating_cache(n, 32, 18)], 75),
    "window-after-prefill": (lambda n: [prefilled_rotating_cache(n, 24, 20, 19)], 70),
    "window-growing": (lambda n: [rotating_cache(n, 64, 21)], 20),
    "arrays-ssm": (lambda n: [arrays_cache(10)], 30),
    "arrays-bf16": (lambda n: [arrays_cache(11, mx.bfloat16)], 30),
    "chunked": (lambda n: [chunked_cache(n, 128, 12)], 60),
    "chunked-trimmed-front": (lambda n: [chunked_cache(n, 32, 13)], 60),
    "cache-list-nested": (lambda n: [cache_list(n, 14)], 45),
    "hybrid-model-like": (
        lambda n: [kv_cache(n, 15), arrays_cache(16), rotating_cache(n, 32, 17)],
        48,
    ),
}


def _check_same(a: list[Any], b: list[Any]) -> None:
    assert [type(x) for x in a] == [type(x) for x in b]
    for x, y in zip(a, b, strict=True):
        xs, ys = state_arrays(x), state_arrays(y)
        assert len(xs) == len(ys)
        for p, q in zip(xs, ys, strict=True):
            assert same_bits(p, q), f"{type(x).__name__}: arrays differ"
        for attr in (
            "offset",
            "max_size",
            "keep",
            "_idx",
            "group_size",
            "bits",
            "chunk_size",
            "start_position",
        ):
            assert getattr(x, attr, None) == getattr(y, attr, None), attr


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_bit_exact(tmp_path: Path, name: str) -> None:
    build, n = CASES[name]
    cache = build(n)
    tokens = list(range(100, 100 + n))
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=16) as store:
        info = store.save(tokens, cache)
        m = store.lookup(tokens)
        assert m is not None and m.exact and m.length == n and m.entry_id == info.id
        _check_same(cache, store.load(m))


def test_restored_kvcache_has_step_capacity_and_a_free_slot(tmp_path: Path) -> None:
    for n in (1, 255, 256, 300):
        tokens = list(range(n))
        with kvstore.Store.open(tmp_path / f"r{n}", namespace=NS, block_tokens=16) as store:
            store.save(tokens, [kv_cache(n, 0)])
            (c,), got = store.restore(tokens)
        assert got == n and c.offset == n
        assert c.keys.shape[2] == (n // 256 + 1) * 256 > n
        # the first decode step writes in place: capacity unchanged
        k1 = mx.zeros((1, 2, 1, 32), dtype=mx.bfloat16)
        c.update_and_fetch(k1, k1)
        assert c.keys.shape[2] == (n // 256 + 1) * 256


def test_trimmed_restore_of_each_trimmable_kind(tmp_path: Path) -> None:
    n, cut = 70, 37
    tokens = list(range(n))
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=16) as store:
        for layers in (
            [kv_cache(n, 1)],
            [quantized_cache(n, 2)],
            [chunked_cache(n, 128, 3)],
            [rotating_cache(n, 128, 4)],
            [C.CacheList(kv_cache(n, 5), kv_cache(n, 6))],
        ):
            store.save(tokens, layers)
            m = store.lookup(tokens[:cut] + [9999])
            assert m is not None and m.length == cut and not m.exact and m.trimmable
            restored = store.load(m)
            expect = [_trimmed(c, n - cut) for c in layers]
            _check_same(expect, restored)
            store.delete(m.entry_id)


def _trimmed(c: Any, n: int) -> Any:
    import copy

    c = copy.deepcopy(c)
    c.trim(n)
    return c


def test_non_trimmable_entry_serves_only_its_exact_prefix(tmp_path: Path) -> None:
    tokens = list(range(50))
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=16) as store:
        store.save(tokens, [arrays_cache(1)])
        assert store.lookup(tokens[:49]) is None  # shorter: an SSM state cannot be cut
        assert store.lookup(tokens[:20] + [7] * 40) is None  # diverges
        m = store.lookup(tokens + [1, 2, 3])  # its tokens are a prefix of the query
        assert m is not None and m.length == 50 and not m.exact and not m.trimmable
        wrapped = rotating_cache(80, 32, 2)
        store.save(list(range(1000, 1080)), [wrapped])
        assert store.lookup(list(range(1000, 1079))) is None
        m = store.lookup(list(range(1000, 1080)))
        assert m is not None and m.exact


def test_round_trip_in_a_fresh_process(tmp_path: Path) -> None:
    root = tmp_path / "root"
    tokens = list(range(45))
    cache = [cache_list(45, 3), rotating_cache(45, 32, 4), quantized_cache(45, 5)]
    with kvstore.Store.open(root, namespace=NS, block_tokens=16) as store:
        store.save(tokens, cache)
    script = textwrap.dedent(
        f"""
        import sys, mlx.core as mx
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        import kvstore
        from factories import state_arrays
        ns = kvstore.Namespace(model_id="codec-suite")
        with kvstore.Store.open({str(root)!r}, namespace=ns) as s:
            cache, n = s.restore(list(range(45)))
        assert n == 45
        arrays = [a for c in cache for a in state_arrays(c)]
        mx.save_safetensors(sys.argv[1], {{f"{{i:03d}}": a for i, a in enumerate(arrays)}})
        """
    )
    out = tmp_path / "got.safetensors"
    subprocess.run([sys.executable, "-c", script, str(out)], check=True)
    got = mx.load(str(out))
    mine = [a for c in cache for a in state_arrays(c)]
    assert len(got) == len(mine)
    for i, a in enumerate(mine):
        assert same_bits(got[f"{i:03d}"], a)


def test_unknown_cache_class_is_a_typed_error(tmp_path: Path) -> None:
    class MyCache:
        pass

    with kvstore.Store.open(tmp_path / "root", namespace=NS) as store:
        with pytest.raises(kvstore.UnknownCacheTypeError, match="MyCache"):
            store.save([1, 2, 3], [MyCache()])

        # a subclass is not silently treated as its base either
        class MyKV(C.KVCache):
            pass

        with pytest.raises(kvstore.UnknownCacheTypeError, match="MyKV"):
            store.save([1, 2, 3], [MyKV()])
        assert store.stats().entries == 0


def test_each_kv_codec_knows_its_mlx_lm_class_step() -> None:
    """Issue 38, item 17: the codecs plan a layer's capacity with the class's ``step`` without
    importing mlx-lm; it must be mlx-lm's own."""
    from kvstore.codecs import mlxlm

    kinds = [c for c in vars(mlxlm).values()
             if isinstance(c, type) and issubclass(c, mlxlm._KVLike) and c is not mlxlm._KVLike]
    assert len(kinds) >= 5
    for codec in kinds:
        assert codec.step == codec().mlx_class.step, codec.__name__
