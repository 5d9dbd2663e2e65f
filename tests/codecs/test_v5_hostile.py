"""v5 files whose blocks are hostile or many: symlinks, FIFOs, directories, 5,000 blocks."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from factories import kv_cache, same_bits

import kvstore
from kvstore.formats.errors import BlockFileTypeError
from kvstore.formats.v3 import load_v3, read_header
from kvstore.formats.v5file import save_v5

NS = kvstore.Namespace(model_id="tiny", config_fingerprint="cfg", tokenizer_hash="tok")


@pytest.fixture
def v5(samples_dir: Path, tmp_path: Path) -> Path:
    d = tmp_path / "in"
    shutil.copytree(samples_dir / "blocks", d / "blocks")
    for b in (d / "blocks").iterdir():
        b.chmod(0o644)
    shutil.copyfile(samples_dir / "mixed-blocks-v5.kv", d / "mixed-blocks-v5.kv")
    return d / "mixed-blocks-v5.kv"


def _first_block(path: Path) -> tuple[str, Path, int]:
    ref = read_header(path).header["caches"][0]["tensors"][0]["blocks"][0]
    return ref["hash"], path.parent / "blocks" / ref["hash"], ref["bytes"]


def _load_soon(path: Path, **kw: Any) -> BaseException | None:
    """load_v3 in a thread that must finish within 30 s (a FIFO must not hang it)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            load_v3(path, **kw)
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert out, "load_v3 hung"
    return out[0]


@pytest.mark.parametrize("verify", [False, True])
def test_symlinked_block_is_refused_and_its_target_never_read(
    v5: Path, tmp_path: Path, verify: bool
) -> None:
    digest, block, size = _first_block(v5)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret"
    secret.write_bytes(b"S" * size)  # same size: only the file type gives it away
    os.utime(secret, (1_000_000_000, 1_000_000_000))
    before = (secret.read_bytes(), secret.stat().st_mtime_ns, sorted(os.listdir(outside)))
    block.unlink()
    block.symlink_to(secret)
    err = _load_soon(v5, verify=verify)
    assert isinstance(err, BlockFileTypeError), err
    assert digest in str(err) and "symlink" in str(err) and str(v5) in str(err)
    assert hashlib.sha256(b"S" * size).hexdigest() not in str(err)
    assert before == (secret.read_bytes(), secret.stat().st_mtime_ns, sorted(os.listdir(outside)))


@pytest.mark.parametrize("make, what", [(os.mkfifo, "a FIFO"), (os.mkdir, "a directory")],
                         ids=["fifo", "directory"])
def test_block_that_is_not_a_regular_file(v5: Path, make: Any, what: str) -> None:
    digest, block, _ = _first_block(v5)
    block.unlink()
    make(block)
    err = _load_soon(v5, verify=True)
    assert isinstance(err, BlockFileTypeError), err
    assert digest in str(err) and what in str(err)


def test_import_refuses_a_symlinked_block(v5: Path, tmp_path: Path) -> None:
    _, block, size = _first_block(v5)
    target = tmp_path / "outside.bin"
    target.write_bytes(bytes(size))
    block.unlink()
    block.symlink_to(target)
    with kvstore.Store.open(tmp_path / "root", create=True, durable=False) as store:
        with pytest.raises(BlockFileTypeError):
            store.import_file(v5)
        assert store.stats().entries == 0


@pytest.fixture
def low_fd_limit() -> Iterator[int]:
    """The soft RLIMIT_NOFILE lowered to 1024 (mlx-lm lowers it to 2048), then restored."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(1024, hard) if hard != resource.RLIM_INFINITY else 1024
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        yield low
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_5000_block_file_imports_with_few_fds_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, low_fd_limit: int
) -> None:
    cache = kv_cache(1280, seed=3)
    out = tmp_path / "v5" / "big.kv"
    out.parent.mkdir()
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", lambda fd: None)  # 5,000 block files: no need to sync them here
        save_v5(out, list(range(1280)), [cache], namespace=NS, block_bytes=64)
    n_blocks = len(os.listdir(out.parent / "blocks"))
    assert n_blocks >= 5000 > low_fd_limit
    loaded = load_v3(out, verify=True)
    assert same_bits(loaded.cache[0].keys[:, :, :1280], cache.keys[:, :, :1280])
    with kvstore.Store.open(tmp_path / "root", create=True, durable=False) as store:
        info = store.import_file(out)
        hit = store.restore(list(range(1280)), namespace=NS)
        assert info.n_tokens == 1280 and hit is not None
    mx.eval(loaded.cache[0].values)
