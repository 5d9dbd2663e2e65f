"""Faults a long-running server meets (issue 17): caches that cannot be restored, bad
shapes and tokens, a full disk, a failed export, a fork.

Each test builds its own root in ``tmp_path``; nothing outside it is touched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from helpers.kv import NS, make_cache, matches, open_store, tokens_for
from mlx_lm.models import cache as C

import kvstore
from kvstore.errors import (
    CacheMismatchError,
    InvalidTokensError,
    KVStoreError,
    StoreFullError,
)

TESTS = Path(__file__).resolve().parent


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def kv_of(shape: tuple[int, ...], dtype: mx.Dtype) -> C.KVCache:
    c = C.KVCache()
    k = mx.random.normal(shape, key=mx.random.key(1)).astype(dtype)
    c.update_and_fetch(k, k + 1)
    return c


def assert_untouched(s: kvstore.Store) -> None:
    assert s.stats().entries == 0
    assert not [p for p in (s.root / "blocks").rglob("*") if p.is_file()]
    assert os.listdir(s.root / "tmp") == []


# --- item 8: a cache that cannot be restored is not saved ---------------------------------


@pytest.mark.parametrize("dtype", [mx.float64, mx.complex64])
def test_an_unrestorable_dtype_is_refused_at_save(tmp_path: Path, dtype: mx.Dtype) -> None:
    with open_store(tmp_path / "r") as s:
        t = list(range(1, 21))
        with pytest.raises(KVStoreError, match=str(dtype).removeprefix("mlx.core.")) as e:
            s.save(t, [kv_of((1, 2, 20, 8), dtype)])
        assert isinstance(e.value, TypeError)
        assert_untouched(s)
        assert s.lookup(t) is None


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32, mx.int8, mx.uint32])
def test_every_dtype_that_saves_also_restores(tmp_path: Path, dtype: mx.Dtype) -> None:
    with open_store(tmp_path / "r") as s:
        t = list(range(1, 21))
        c = kv_of((1, 2, 20, 8), dtype)
        s.save(t, [c])
        cache, n = s.restore(t, verify=True)
        assert cache is not None and n == 20
        assert cache[0].keys.dtype == dtype
        assert mx.array_equal(cache[0].keys[:, :, :20], c.keys[:, :, :20]).item()


# --- item 9: bad shapes, namespaces and tokens are typed errors ------------------------------


def test_two_dimensional_keys_are_a_typed_error(tmp_path: Path) -> None:
    with open_store(tmp_path / "r") as s:
        c = C.KVCache()
        c.keys, c.values, c.offset = mx.zeros((4, 8)), mx.zeros((4, 8)), 4
        with pytest.raises(CacheMismatchError, match=r"\(4, 8\)"):
            s.save([1, 2, 3, 4], [c])
        assert_untouched(s)


@pytest.mark.parametrize("shape", [(1, 0, 4, 8), (1, 2, 4, 0)])
def test_a_zero_size_tensor_is_a_typed_error(tmp_path: Path, shape: tuple[int, ...]) -> None:
    with open_store(tmp_path / "r") as s:
        with pytest.raises(CacheMismatchError, match="zero"):
            s.save([1, 2, 3, 4], [kv_of(shape, mx.float16)])
        a = C.ArraysCache(2)
        a[0] = mx.zeros((1, 3, 8))
        a[1] = mx.zeros((1, 0, 8))
        with pytest.raises(CacheMismatchError, match="zero"):
            s.save([1, 2, 3], [a])
        assert_untouched(s)


@pytest.mark.parametrize(
    "fields",
    [{"model_id": None}, {"model_id": 3}, {"model_id": "m", "ns": None},
     {"model_id": "m", "tokenizer_hash": b"x"}, {"model_id": "m", "config_fingerprint": 1.5}],
)
def test_a_namespace_with_a_non_str_field_is_refused_at_construction(
    fields: dict[str, Any],
) -> None:
    with pytest.raises(KVStoreError) as e:
        kvstore.Namespace(**fields)
    assert isinstance(e.value, TypeError)
    name = next(k for k, v in fields.items() if not isinstance(v, str))
    assert name in str(e.value)


def test_a_valid_namespace_still_round_trips() -> None:
    import msgspec

    ns = kvstore.Namespace(model_id="m", config_fingerprint="c", tokenizer_hash="t", ns="n")
    assert msgspec.json.decode(msgspec.json.encode(ns), type=kvstore.Namespace) == ns
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"model_id": null}', type=kvstore.Namespace)


@pytest.mark.parametrize(
    "tokens",
    [[1, True, 3], [False], (5, 6, True), np.array([True, False]), mx.array([True, True])],
    ids=["list", "only", "tuple", "numpy", "mlx"],
)
def test_bools_are_not_tokens(tmp_path: Path, tokens: Any) -> None:
    with open_store(tmp_path / "r") as s:
        with pytest.raises(InvalidTokensError, match="bool"):
            s.save(tokens, make_cache([1] * len(tokens)))
        with pytest.raises(InvalidTokensError, match="bool"):
            s.lookup(tokens)
        assert_untouched(s)


# --- item 10: failures leave no temp files -----------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (needs root and mount); skipped where one cannot be made."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip(reason="the full-disk test requires the mount command (for a small fs)")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(reason=f"the full-disk test requires a 2 MiB tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _big_cache(seed: int, n: int) -> list[Any]:
    """Four fp16 layers of H2 D32: 1 KiB per token per layer, nothing shared."""
    out = []
    for layer in range(4):
        c = C.KVCache()
        k = mx.random.normal((1, 2, n, 32), key=mx.random.key(seed * 10 + layer))
        c.update_and_fetch(k.astype(mx.float16), (k + 1).astype(mx.float16))
        out.append(c)
    return out


def test_a_save_that_fills_the_disk_leaves_no_temp_files(small_fs: Path) -> None:
    root = small_fs / "r"
    with open_store(root) as s:
        failures = 0
        saved: list[list[int]] = []
        for i in range(40):
            t = [i * 1000 + j + 1 for j in range(200)]
            try:
                s.save(t, _big_cache(i, 200))
                saved.append(t)
            except StoreFullError:
                failures += 1
                assert os.listdir(root / "tmp") == [], f"after failed save {i}"
                if failures == 3:
                    break
        assert failures == 3 and saved
        assert s.stats().entries == len(saved)
        assert s.verify(read_data=True).sound


@pytest.mark.parametrize("fmt", ["v3", "v5"])
def test_an_export_onto_a_directory_fails_and_leaves_nothing(tmp_path: Path, fmt: str) -> None:
    with open_store(tmp_path / "r") as s:
        t = tokens_for(1, 40)
        eid = s.save(t, make_cache(t)).id
        out = tmp_path / "out"
        target = out / "entry.kv"
        (target / "inside").mkdir(parents=True)
        before = listing(out)
        with pytest.raises(OSError, match="directory"):
            s.export(eid, target, format=fmt)  # type: ignore[arg-type]
        assert listing(out) == before


def test_the_cli_export_onto_a_directory_is_one_error_line(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with open_store(root) as s:
        t = tokens_for(1, 40)
        eid = s.save(t, make_cache(t)).id
    out = tmp_path / "out"
    (out / "entry.kv").mkdir(parents=True)
    before = listing(out)
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_ROOT"}
    r = subprocess.run([sys.executable, "-m", "kvstore", "export", eid[:8], str(out / "entry.kv"),
                        "--root", str(root)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r
    assert r.stderr.startswith("kvstore: error:") and "directory" in r.stderr, r.stderr
    assert listing(out) == before


# --- item 11: a forked child gets a clear error, not a hang --------------------------------

_FORK = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[2])
    mode = sys.argv[3]
    import kvstore
    from helpers.kv import make_cache, matches, open_store, tokens_for
    root = sys.argv[1]
    t = tokens_for(1, 40)
    if mode == "after-use":  # the parent evaluates MLX arrays (a save), then forks
        with open_store(root) as s:
            s.save(t, make_cache(t))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.alarm(20)  # a hang ends here, as a failure
        res = {}
        try:
            with open_store(root) as s:
                res["lookup"] = s.lookup(t) is not None
                if mode == "before-use":
                    s.save(t, make_cache(t))
                cache, n = s.restore(t)
                res["restored"] = cache is not None and matches(cache, t, n)
        except Exception as e:
            res["error"] = type(e).__name__
            res["typed"] = isinstance(e, kvstore.KVStoreError)
            res["message"] = str(e)
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": status, "child": json.loads(data) if data else None}))
    """
)


def _fork_run(root: Path, mode: str) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-c", _FORK, str(root), str(TESTS), mode],
                       capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_child_forked_after_mlx_was_used_gets_a_clear_error(tmp_path: Path) -> None:
    res = _fork_run(tmp_path / "r", "after-use")
    assert res["status"] == 0, res  # not killed by its alarm: it did not hang
    child = res["child"]
    assert child["lookup"] is True, child  # the index works in the child
    assert child["typed"] and "fork" in child["message"], child


def test_a_child_forked_before_mlx_was_used_works(tmp_path: Path) -> None:
    """The supported pattern: fork first, open the store and use MLX in the child."""
    res = _fork_run(tmp_path / "r", "before-use")
    assert res["status"] == 0, res
    assert res["child"] == {"lookup": False, "restored": True}, res


def test_default_namespace_is_still_used(tmp_path: Path) -> None:
    with kvstore.Store.open(tmp_path / "r", namespace=NS, durable=False) as s:
        t = tokens_for(4, 40)
        s.save(t, make_cache(t))
        cache, n = s.restore(t)
        assert cache is not None and matches(cache, t, n)
