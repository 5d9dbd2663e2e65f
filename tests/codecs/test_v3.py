"""mlx-bun v3/v4/v5 files: the reference samples read exactly and write back byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

from kvstore.codecs import RawCache
from kvstore.formats.v3 import Loaded, load_v3, read_header, save_v3
from kvstore.formats.v5file import save_v5

V3_SAMPLES = ["tiny", "kv-plain", "mixed", "with-attachments"]
ALL_SAMPLES = [*V3_SAMPLES, "mixed-blocks-v5"]
_CLASS = {"kv": C.KVCache, "rotating": C.RotatingKVCache, "qkv": C.QuantizedKVCache,
          "ssm": C.ArraysCache}


def _expect(samples_dir: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((samples_dir / f"{name}.kv.expect.json").read_text())
    return data


def _bytes(a: mx.array) -> bytes:
    a = mx.contiguous(a)
    mx.eval(a)
    return memoryview(a).cast("B").tobytes()  # type: ignore[arg-type]


def _layer_tensors(layer: Any, offset: int | None) -> list[mx.array]:
    """The tensors as mlx-bun stored them: KV rows sliced back to the offset."""
    if isinstance(layer, RawCache):
        return list(layer.tensors)
    if isinstance(layer, C.ArraysCache):
        return [a for a in layer.cache if a is not None]
    if isinstance(layer, C.QuantizedKVCache):
        return [a[..., :offset, :] for a in (*layer.keys, *layer.values)]
    if isinstance(layer, C.RotatingKVCache):
        return [layer.keys, layer.values]
    return [layer.keys[..., :offset, :], layer.values[..., :offset, :]]


def _stored_tensors(loaded: Loaded) -> list[mx.array]:
    out: list[mx.array] = []
    for layer, entry in zip(loaded.cache, loaded.header["caches"], strict=True):
        out.extend(_layer_tensors(layer, entry.get("offset")))
    for att in loaded.attachments:
        out.extend(att.tensors)
    return out


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("name", ALL_SAMPLES)
def test_sample_reads_exact_tensors(samples_dir: Path, name: str, verify: bool) -> None:
    exp = _expect(samples_dir, name)
    loaded = load_v3(samples_dir / f"{name}.kv", verify=verify)
    assert loaded.format_version == exp["formatVersion"]
    assert loaded.header == exp["header"]
    assert list(loaded.header) == list(exp["header"])  # key order kept
    assert loaded.tokens == exp["header"]["tokens"]
    assert len(loaded.tokens) == exp["tokens"]["count"]
    kinds = [e["kind"] for e in exp["header"]["caches"]]
    assert [type(c) for c in loaded.cache] == [_CLASS[k] for k in kinds]
    tensors = _stored_tensors(loaded)
    assert len(tensors) == len(exp["tensors"])
    for arr, t in zip(tensors, exp["tensors"], strict=True):
        assert list(arr.shape) == t["shape"], t["name"]
        assert str(arr.dtype).rsplit(".", 1)[-1] == t["dtype"], t["name"]
        assert hashlib.sha256(_bytes(arr)).hexdigest() == t["sha256"], t["name"]
    assert [a.schema for a in loaded.attachments] == [
        a["schema"] for a in exp["header"].get("attachments", [])
    ]
    for att, a in zip(loaded.attachments, exp["header"].get("attachments", []), strict=True):
        assert json.loads(att.metadata) == a["metadata"]


def test_mixed_layers_restore_as_mlx_lm_objects(samples_dir: Path) -> None:
    loaded = load_v3(samples_dir / "mixed.kv")
    kv, rot, q, ssm = loaded.cache
    assert kv.offset == 300 and kv.keys.shape == (1, 2, 512, 64)  # step capacity, free slot
    assert not mx.any(kv.keys[..., 300:, :]).item()
    assert rot.offset == 500 and rot._idx == 37 and rot.max_size == 128 and rot.keep == 0
    assert q.offset == 300 and q.group_size == 64 and q.bits == 4
    assert q.keys[0].shape == (1, 2, 512, 8) and q.keys[0].dtype == mx.uint32
    assert [a.shape for a in ssm.cache] == [(1, 3, 256), (1, 4, 32, 32)]
    assert json.loads(ssm.kvstore_extra) == {"offset": 300}


def test_tiny_capacity_rounds_up_to_step(samples_dir: Path) -> None:
    (kv,) = load_v3(samples_dir / "tiny.kv").cache
    assert kv.offset == 5 and kv.keys.shape == (1, 1, C.KVCache.step, 8)
    k, v = kv.update_and_fetch(mx.zeros((1, 1, 1, 8), mx.bfloat16),
                               mx.zeros((1, 1, 1, 8), mx.bfloat16))
    assert k.shape == (1, 1, 6, 8) and kv.keys.shape[2] == C.KVCache.step


@pytest.mark.parametrize("name", ALL_SAMPLES)
def test_read_header(samples_dir: Path, name: str) -> None:
    exp = _expect(samples_dir, name)
    info = read_header(samples_dir / f"{name}.kv")
    assert info.header_len == exp["prefix"]["headerLen"]
    assert info.data_start == exp["prefix"]["dataStart"]
    assert info.header_hash_hex == exp["prefix"]["headerHash"]
    assert info.header == exp["header"]
    assert info.format_version == exp["formatVersion"]
    assert info.file_size == exp["fileBytes"]


@pytest.mark.parametrize("name", V3_SAMPLES)
def test_read_then_write_is_byte_identical(samples_dir: Path, tmp_path: Path, name: str) -> None:
    src = samples_dir / f"{name}.kv"
    loaded = load_v3(src)
    out = tmp_path / src.name
    save_v3(out, loaded.tokens, loaded.cache, namespace=loaded.namespace,
            attachments=loaded.attachments, created_at=loaded.header["createdAt"])
    assert out.read_bytes() == src.read_bytes()
    assert hashlib.sha256(out.read_bytes()).hexdigest() == _expect(samples_dir, name)["fileSha256"]
    assert [p.name for p in tmp_path.iterdir()] == [src.name]  # no temp file left


def test_v5_sample_writes_back_with_the_same_blocks(samples_dir: Path, tmp_path: Path) -> None:
    src = samples_dir / "mixed-blocks-v5.kv"
    exp = _expect(samples_dir, "mixed-blocks-v5")
    loaded = load_v3(src, verify=True)
    out = tmp_path / src.name
    save_v5(out, loaded.tokens, loaded.cache, namespace=loaded.namespace,
            created_at=loaded.header["createdAt"], block_bytes=exp["blockBytes"])
    assert out.read_bytes() == src.read_bytes()
    ours = {p.name: p.read_bytes() for p in (tmp_path / "blocks").iterdir()}
    theirs = {p.name: p.read_bytes() for p in (samples_dir / "blocks").iterdir()}
    assert ours == theirs


def test_v3_sample_rewritten_as_v5_reads_the_same(samples_dir: Path, tmp_path: Path) -> None:
    loaded = load_v3(samples_dir / "with-attachments.kv")
    out = tmp_path / "x.kv"
    save_v5(out, loaded.tokens, loaded.cache, namespace=loaded.namespace,
            attachments=loaded.attachments, created_at=1, block_bytes=10_000)
    again = load_v3(out, verify=True)
    assert again.format_version == 5
    for a, b in zip(_stored_tensors(loaded), _stored_tensors(again), strict=True):
        assert _bytes(a) == _bytes(b)
    assert [x.metadata for x in again.attachments] == [x.metadata for x in loaded.attachments]
    for slot in again.header["caches"][0]["tensors"]:
        assert sum(b["bytes"] for b in slot["blocks"]) == slot["bytes"]
        assert all(b["bytes"] <= 10_000 for b in slot["blocks"])
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "blocks").iterdir())
    assert os.listdir(tmp_path) == ["blocks", "x.kv"] or sorted(os.listdir(tmp_path)) == [
        "blocks", "x.kv"]
