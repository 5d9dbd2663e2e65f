"""Entries of thousands of blocks restore under the file limit mlx-lm sets (issue 29, item 5).

Importing mlx-lm lowers the soft RLIMIT_NOFILE to 2048; a restore, a verified load and an
export hold a bounded number of block descriptors at once, whatever the entry's size.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from factories import prefix_cache, token_rows

import kvstore
from kvstore.errors import BlockNotFoundError
from kvstore.local import reader

NS = kvstore.Namespace(model_id="tiny-big", config_fingerprint="cfg", tokenizer_hash="tok")
H, D = 1, 2  # tiny rows: 600k tokens are a few MB
SOFT_LIMIT = 2048  # what importing mlx-lm sets


@pytest.fixture
def file_limit() -> Iterator[int]:
    """The soft RLIMIT_NOFILE at 2048 for the test, restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < SOFT_LIMIT:
        pytest.fail(f"the hard file limit {hard} is below {SOFT_LIMIT}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT_LIMIT, hard))
    try:
        yield SOFT_LIMIT
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _tokens(n: int) -> list[int]:
    return [1 + (i * 7919) % 30011 for i in range(n)]


def _rows_match(cache: list, tokens: list[int]) -> bool:
    c = cache[0]
    n = len(tokens)
    return bool(
        c.offset == n
        and mx.array_equal(c.keys[:, :, :n], token_rows(tokens, 0, heads=H, dim=D,
                                                         dtype=mx.float16)).item()
        and mx.array_equal(c.values[:, :, :n], token_rows(tokens, 1000, heads=H, dim=D,
                                                           dtype=mx.float16)).item()
    )


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1


@pytest.mark.parametrize(("n_tokens", "block_tokens"), [(600_000, 256), (40_000, 16)])
def test_an_entry_of_more_blocks_than_the_file_limit_restores_bit_exact(
    tmp_path: Path, file_limit: int, n_tokens: int, block_tokens: int
) -> None:
    tokens = _tokens(n_tokens)
    assert n_tokens // block_tokens > file_limit  # more blocks than descriptors allowed
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=block_tokens,
                            durable=False) as s:
        info = s.save(tokens, [prefix_cache(tokens, mx.float16, heads=H, dim=D)])
        before = _open_fds()
        for verify in (True, False):
            cache, length = s.restore(tokens, verify=verify)
            assert length == n_tokens
            assert cache is not None and _rows_match(cache, tokens)
        # a prefix that ends inside a block, and a verified load of the whole entry
        part = n_tokens - block_tokens * 3 - 5
        cache, length = s.restore(tokens[:part] + [0], verify=True)
        assert length == part and cache is not None and _rows_match(cache, tokens[:part])
        got, cache, _ = s.load_entry(info.id, verify=True)
        assert got == tokens and _rows_match(cache, tokens)
        out = s.export(info.id, tmp_path / "big.v5", format="v5")
        assert out.stat().st_size > 0
        if before >= 0:
            assert _open_fds() == before  # every block descriptor was closed


def test_a_bad_block_past_the_first_window_is_found_and_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a window of 4 blocks, a block of the third window that reads bad is
    quarantined and the intact prefix restores; one that is missing is a
    BlockNotFoundError naming it (a miss for restore), as in the first window."""
    monkeypatch.setattr(reader, "FD_WINDOW", 4)
    tokens = _tokens(16 * 20)
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=16,
                            durable=False) as s:
        info = s.save(tokens, [prefix_cache(tokens, mx.float16, heads=H, dim=D)])
        before = _open_fds()
        m = s.manifest(info.id)
        bad = m.token_blocks[9]
        path = Path(s.local.blocks.where(bad))
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        cache, length = s.restore(tokens)
        assert length == 16 * 9  # the longest intact prefix: blocks 0..8
        assert cache is not None and _rows_match(cache, tokens[:length])
        assert not path.exists()  # quarantined
        # a whole, fresh entry again: then its block 13 vanishes before a read
        info = s.save(tokens, [prefix_cache(tokens, mx.float16, heads=H, dim=D)])
        cache, length = s.restore(tokens)
        assert length == len(tokens) and cache is not None and _rows_match(cache, tokens)
        for b in (13, 1):  # the fourth window, then the first
            d = s.manifest(info.id).token_blocks[b]
            Path(s.local.blocks.where(d)).unlink()
            with pytest.raises(BlockNotFoundError, match=d.hex()):
                s.load_entry(info.id)
            assert s.restore(tokens) == (None, 0)
            assert _open_fds() == before
