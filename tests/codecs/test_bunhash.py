"""Bun.hash (Zig std.hash.Wyhash, seed 0) against mlx-bun's vectors."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kvstore.formats.bunhash import BunHasher, bun_hash, bun_hash_hex, hex64


def _input(v: dict[str, Any]) -> bytes:
    n, gen = v["length"], v["generator"]
    if gen.startswith("SEQ"):
        return bytes(i % 251 for i in range(n))
    if gen.startswith("PAT"):
        return bytes(((i * 131) ^ (i // 128)) % 256 for i in range(n))
    return bytes.fromhex(v["inputHex"])


def _vectors(vectors_dir: Path) -> list[dict[str, Any]]:
    data = json.loads((vectors_dir / "bunhash.json").read_text())
    vs: list[dict[str, Any]] = data["vectors"]
    return vs


def test_every_vector(vectors_dir: Path) -> None:
    vs = _vectors(vectors_dir)
    assert len(vs) > 100
    for v in vs:
        data = _input(v)
        assert len(data) == v["length"]
        assert bun_hash_hex(data) == v["hash"], v["name"]
        assert bun_hash(data) == int(v["hashDecimal"]), v["name"]


def test_streaming_any_split_matches(vectors_dir: Path) -> None:
    rng = random.Random(7)
    for v in _vectors(vectors_dir):
        data = _input(v)
        if len(data) > 70_000:
            continue
        for _ in range(3):
            h = BunHasher()
            i = 0
            while i < len(data):
                k = rng.choice([0, 1, 5, 15, 16, 17, 47, 48, 49, 100, 4096])
                h.update(data[i : i + k])
                i += k
            assert h.hexdigest() == v["hash"], v["name"]
            assert h.total_len == len(data)


def test_large_vector_streamed_in_pieces(vectors_dir: Path) -> None:
    v = next(x for x in _vectors(vectors_dir) if x["name"] == "pat:16MiB+7")
    data = memoryview(_input(v))
    h = BunHasher()
    for i in range(0, len(data), 1 << 20):
        h.update(data[i : i + (1 << 20)])
    assert h.hexdigest() == v["hash"]


def test_intdigest_is_idempotent_and_copy_is_independent() -> None:
    h = BunHasher(b"hello")
    assert h.intdigest() == h.intdigest() == bun_hash(b"hello")
    c = h.copy()
    c.update(b" world")
    assert c.intdigest() == bun_hash(b"hello world")
    assert h.intdigest() == bun_hash(b"hello")


def test_accepts_buffers_and_mlx_arrays() -> None:
    raw = bytes(range(256)) * 40
    expect = bun_hash(raw)
    assert bun_hash(bytearray(raw)) == expect
    assert bun_hash(memoryview(raw)) == expect
    for dtype in (mx.bfloat16, mx.float16, mx.float32, mx.uint8):
        arr = mx.random.uniform(shape=(3, 5, 7)).astype(dtype)
        mx.eval(arr)
        mv = memoryview(arr)
        assert bun_hash(arr) == bun_hash(mv) == bun_hash(mv.cast("B").tobytes())


def test_rejects_non_contiguous_and_non_buffers() -> None:
    with pytest.raises(TypeError):
        bun_hash("text")  # type: ignore[arg-type]
    with pytest.raises((BufferError, TypeError, ValueError)):
        bun_hash(memoryview(bytes(10))[::2])


def test_hex64_zero_pads() -> None:
    assert hex64(0xAB) == "00000000000000ab"


def test_threads_hash_concurrently() -> None:
    data = bytes(range(256)) * 4096
    expect = bun_hash(data)
    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(bun_hash(data))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [expect] * 4
