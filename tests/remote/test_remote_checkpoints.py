"""Checkpoints and sliding windows on the remote tier (issue 26), against the real gateway:
a window entry's blocks travel with it, a checkpoint pulled by a second machine restores
bit for bit and is still a checkpoint there (thinned first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

import kvstore
from kvstore.schema import WindowLayer

NS = kvstore.Namespace(model_id="remote-checkpoints")
T = 16


def _cache(n: int, seed: int) -> list[Any]:
    """A hybrid of a full layer, a sliding window fed as a prefill does, and an SSM state."""
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed)).astype(mx.float16)
    kv = KVCache()
    kv.update_and_fetch(k, k + 1)
    ring = RotatingKVCache(max_size=24, keep=0)
    for a in range(0, n, 20):
        ring.update_and_fetch(k[:, :, a : a + 20], k[:, :, a : a + 20] - 1)
    ssm = ArraysCache(1)
    ssm[0] = mx.full((1, 4, 8), float(seed))
    return [kv, ring, ssm]


def _bits(cache: list[Any]) -> list[bytes]:
    arrays = [*cache[0].keys_and_values(), cache[1].keys, cache[1].values, cache[2][0]]
    mx.eval(arrays)
    return [bytes(memoryview(a)) for a in arrays] + [
        str((cache[1].offset, cache[1]._idx)).encode()]


def test_a_checkpoint_with_a_window_travels_through_the_bucket(tmp_path: Path, url: str) -> None:
    toks = list(range(500, 500 + 6 * T))
    original = _cache(len(toks), 3)
    with kvstore.Store.open(tmp_path / "a", namespace=NS, block_tokens=T, remote=url) as a:
        info = a.save(toks, original, priority="checkpoint",
                      metadata={"cache_type": "checkpoint"})
        m = a.manifest(info.id)
        assert isinstance(m.layers[1], WindowLayer) and m.window_blocks
        pushed = a.push()
        assert pushed.failed == 0 and pushed.pending == 0
    with kvstore.Store.open(tmp_path / "b", namespace=NS, block_tokens=T, remote=url) as b:
        cache, n = b.restore(toks + [1, 2, 3])  # pulled from the bucket: no local entry
        assert n == len(toks) and cache is not None
        assert _bits(cache) == _bits(original)
        (entry,) = list(b.entries())
        assert entry.id == info.id and entry.priority == "checkpoint"
        got = b.manifest(entry.id)
        assert got.window_blocks == m.window_blocks  # every window block came with it
        assert b.verify(read_data=True).sound
