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


# --- issue 38, item 19: the pure-Python port, used when the extension is absent -----------


def test_the_pure_python_port_agrees_with_the_extension_on_every_vector(
    vectors_dir: Path,
) -> None:
    from kvstore import _wyhash
    from kvstore.formats import wyhash_python

    rng = random.Random(11)
    vs = [v for v in _vectors(vectors_dir) if v["length"] <= 1 << 20]  # 1 MiB: 5 chunks
    assert len(vs) > 100
    for v in vs:
        data = _input(v)
        want = int(v["hashDecimal"])
        assert wyhash_python.hash(data) == _wyhash.hash(data) == want, v["name"]
        if len(data) > 70_000:
            continue
        py, c = wyhash_python.Wyhash(), _wyhash.Wyhash()
        i = 0
        while i < len(data):
            k = rng.choice([0, 1, 5, 15, 16, 17, 47, 48, 49, 100, 4096])
            py.update(data[i : i + k])
            c.update(data[i : i + k])
            i += k
            if rng.random() < 0.1:  # a digest midway leaves the state as it was
                assert py.intdigest() == c.intdigest() and py.copy().intdigest() == c.intdigest()
        assert (py.intdigest(), py.total_len) == (want, len(data)), v["name"]
    # seeds, and the buffers the store hands it (an MLX array, a memoryview of one)
    arr = mx.arange(1000, dtype=mx.float16)
    mx.eval(arr)
    for seed in (0, 1, 2**64 - 1):
        assert wyhash_python.hash(arr, seed) == _wyhash.hash(arr, seed)
        assert wyhash_python.hash(memoryview(arr), seed) == _wyhash.hash(memoryview(arr), seed)


def test_the_port_is_used_when_the_extension_is_absent(vectors_dir: Path) -> None:
    import subprocess
    import sys

    v = next(x for x in _vectors(vectors_dir) if x["length"] == 1000)
    code = (
        "import sys\n"
        "sys.modules['kvstore._wyhash'] = None  # as an install without a C compiler\n"
        "from kvstore.formats import bunhash\n"
        f"data = bytes.fromhex('{_input(v).hex()}')\n"
        "h = bunhash.BunHasher(data[:333]); h.update(data[333:])\n"
        "print(bunhash.IMPLEMENTATION, bunhash.bun_hash_hex(data), h.hexdigest())\n"
    )
    p = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["python", v["hash"], v["hash"]]
    from kvstore.formats import bunhash

    assert bunhash.IMPLEMENTATION == "C"  # here, where it was built


def test_setup_builds_the_extension_optionally(tmp_path: Path) -> None:
    """Without a working C compiler ``build_ext`` warns and succeeds (the port takes over)."""
    import os
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "kvstore").mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "kvstore/_wyhash.c"):
        shutil.copy(repo / name, tmp_path / name)
    p = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CC": "false"})
    assert p.returncode == 0, p.stderr
    assert 'building extension "kvstore._wyhash" failed' in p.stderr
    assert not list((tmp_path / "kvstore").glob("_wyhash*.so"))
