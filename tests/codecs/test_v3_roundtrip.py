"""Write-then-read through the v3 and v5 files is bit-exact for every cache kind."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

from kvstore.codecs import AttachmentData, RawCache
from kvstore.errors import CacheMismatchError
from kvstore.formats.v3 import load_v3, read_header, save_v3
from kvstore.formats.v5file import save_v5
from kvstore.schema import Namespace

DTYPES = [mx.bfloat16, mx.float16, mx.float32]
NS = Namespace(model_id="m", config_fingerprint="c", tokenizer_hash="t", ns="x")
SAVERS: list[Callable[..., None]] = [save_v3, save_v5]


def _raw(a: mx.array) -> bytes:
    a = mx.contiguous(a)
    mx.eval(a)
    return memoryview(a).cast("B").tobytes()  # type: ignore[arg-type]


def _same(a: mx.array, b: mx.array) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert mx.array_equal(a, b).item()
    assert _raw(a) == _raw(b)


def _rand(shape: tuple[int, ...], dtype: mx.Dtype, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _kv(dtype: mx.Dtype, n: int = 37) -> C.KVCache:
    c = C.KVCache()
    c.update_and_fetch(_rand((1, 2, n, 16), dtype, 1), _rand((1, 2, n, 16), dtype, 2))
    return c


def _rotating(dtype: mx.Dtype, n: int, keep: int = 0) -> C.RotatingKVCache:
    c = C.RotatingKVCache(max_size=16, keep=keep)
    for i in range(n):  # one token at a time: the ring wraps in place
        c.update_and_fetch(_rand((1, 2, 1, 8), dtype, 10 + i), _rand((1, 2, 1, 8), dtype, 99 + i))
    return c


def _quantized(dtype: mx.Dtype, bits: int = 4) -> C.QuantizedKVCache:
    c = C.QuantizedKVCache(group_size=32, bits=bits)
    c.update_and_fetch(_rand((1, 2, 20, 64), dtype, 3), _rand((1, 2, 20, 64), dtype, 4))
    return c


def _arrays(dtype: mx.Dtype) -> C.ArraysCache:
    c = C.ArraysCache(size=2)
    c[0] = _rand((1, 3, 24), dtype, 5)
    c[1] = _rand((1, 2, 4, 4), dtype, 6)
    return c


def _tensors(layer: Any) -> list[mx.array]:
    if isinstance(layer, RawCache):
        return list(layer.tensors)
    if isinstance(layer, C.ArraysCache):
        return [a for a in layer.cache if a is not None]
    if isinstance(layer, C.QuantizedKVCache):
        n = layer.offset
        return [a[..., :n, :] for a in (*layer.keys, *layer.values)]
    if isinstance(layer, C.RotatingKVCache):
        n = min(layer.offset, layer.keys.shape[2])
        return [layer.keys[..., :n, :], layer.values[..., :n, :]]
    return [layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]]


def _round_trip(tmp_path: Path, save: Callable[..., None], cache: list[Any], **kw: Any) -> Any:
    path = tmp_path / "entry.kv"
    tokens = list(range(100, 137))
    save(path, tokens, cache, namespace=NS, created_at=1234, **kw)
    loaded = load_v3(path, verify=True, namespace=NS)
    assert loaded.tokens == tokens
    assert loaded.header["createdAt"] == 1234
    assert len(loaded.cache) == len(cache)
    for a, b in zip(cache, loaded.cache, strict=True):
        assert type(a) is type(b)
        for x, y in zip(_tensors(a), _tensors(b), strict=True):
            _same(x, y)
    return loaded


@pytest.mark.parametrize("save", SAVERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv(tmp_path: Path, save: Callable[..., None], dtype: mx.Dtype) -> None:
    (kv,) = _round_trip(tmp_path, save, [_kv(dtype)]).cache
    assert kv.offset == 37 and kv.keys.shape[2] == C.KVCache.step


@pytest.mark.parametrize("save", SAVERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [5, 16, 23])  # before, at and after the ring wraps
def test_rotating(tmp_path: Path, save: Callable[..., None], dtype: mx.Dtype, n: int) -> None:
    src = _rotating(dtype, n)
    (rot,) = _round_trip(tmp_path, save, [src]).cache
    assert (rot.offset, rot._idx, rot.max_size, rot.keep) == (src.offset, src._idx, 16, 0)


def test_rotating_keep_written_only_when_set(tmp_path: Path) -> None:
    (rot,) = _round_trip(tmp_path, save_v3, [_rotating(mx.float16, 20, keep=4)]).cache
    assert rot.keep == 4
    assert read_header(tmp_path / "entry.kv").header["caches"][0]["keep"] == 4
    _round_trip(tmp_path, save_v3, [_rotating(mx.float16, 20)])
    assert "keep" not in read_header(tmp_path / "entry.kv").header["caches"][0]


@pytest.mark.parametrize("save", SAVERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized(tmp_path: Path, save: Callable[..., None], dtype: mx.Dtype, bits: int) -> None:
    (q,) = _round_trip(tmp_path, save, [_quantized(dtype, bits)]).cache
    assert (q.offset, q.group_size, q.bits) == (20, 32, bits)


@pytest.mark.parametrize("save", SAVERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_arrays_cache_as_ssm(tmp_path: Path, save: Callable[..., None], dtype: mx.Dtype) -> None:
    (ssm,) = _round_trip(tmp_path, save, [_arrays(dtype)]).cache
    entry = read_header(tmp_path / "entry.kv").header["caches"][0]
    assert entry["kind"] == "ssm" and entry["offset"] == 37  # the token count
    assert json.loads(ssm.kvstore_extra) == {"offset": 37}


@pytest.mark.parametrize("save", SAVERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_cache(tmp_path: Path, save: Callable[..., None], dtype: mx.Dtype) -> None:
    fields = b'{"offset":37,"kvLoraRank":8,"ropeHeadDim":4,"maxTokens":null,' \
             b'"minimumReusableOffset":3}'
    raw = RawCache(source_kind="mla", fields=fields,
                   tensors=[_rand((1, 37, 8), dtype, 7), _rand((1, 37, 4), dtype, 8)])
    (back,) = _round_trip(tmp_path, save, [raw]).cache
    assert back.source_kind == "mla" and back.fields == fields and back.trimmable
    entry_keys = list(read_header(tmp_path / "entry.kv").header["caches"][0])
    assert entry_keys == ["kind", "offset", "kvLoraRank", "ropeHeadDim", "maxTokens", "tensors",
                          "minimumReusableOffset"]


def test_extra_fields_survive(tmp_path: Path) -> None:
    kv = _kv(mx.bfloat16)
    kv.kvstore_extra = b'{"minimumReusableOffset":7}'
    (back,) = _round_trip(tmp_path, save_v3, [kv]).cache
    assert back.kvstore_extra == b'{"minimumReusableOffset":7}'
    assert list(read_header(tmp_path / "entry.kv").header["caches"][0]) == [
        "kind", "offset", "tensors", "minimumReusableOffset"]


def test_mixed_layers_and_attachments(tmp_path: Path) -> None:
    cache = [_kv(mx.bfloat16), _rotating(mx.float16, 20), _quantized(mx.float32),
             _arrays(mx.float32)]
    att = AttachmentData(schema="s/v1", metadata=b'{"b":1.5,"a":[1e-7,"\\u00e9"]}',
                         tensors=(mx.arange(10, dtype=mx.int32), mx.ones((3, 3), mx.uint8)))
    loaded = _round_trip(tmp_path, save_v3, cache, attachments=[att])
    assert loaded.format_version == 4
    (got,) = loaded.attachments
    assert got.schema == "s/v1" and json.loads(got.metadata) == json.loads(att.metadata)
    for x, y in zip(att.tensors, got.tensors, strict=True):
        _same(x, y)
    slots = [t for e in loaded.header["caches"] for t in e["tensors"]]
    assert all(t["off"] % 16384 == 0 for t in slots)


def test_noncontiguous_source_is_written_right(tmp_path: Path) -> None:
    kv = C.KVCache()
    k = _rand((1, 16, 2, 8), mx.float32, 9).transpose(0, 2, 1, 3)  # a strided view
    kv.keys, kv.values, kv.offset = k, k * 2, 16
    (back,) = _round_trip(tmp_path, save_v3, [kv]).cache
    _same(back.keys[..., :16, :], k)


def test_namespace_none_omits_identity(tmp_path: Path) -> None:
    save_v3(tmp_path / "a.kv", [1, 2], [_kv(mx.float16, 2)], created_at=5)
    h = read_header(tmp_path / "a.kv").header
    assert list(h) == ["formatVersion", "createdAt", "codecProvider", "tokens", "caches"]
    assert load_v3(tmp_path / "a.kv").namespace is None


def test_unwritable_caches_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(CacheMismatchError):
        save_v3(tmp_path / "a.kv", [1], [])
    odd = C.ArraysCache(size=3)
    odd[0] = mx.zeros((1, 2))
    with pytest.raises(CacheMismatchError):
        save_v3(tmp_path / "a.kv", [1], [odd])
    assert list(tmp_path.iterdir()) == []  # nothing half-written
