"""Issue 37: a process that restores again and again keeps its restores' memory warm,
bounded, and gives it back when idle or short of memory; one restore changes nothing."""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from kvstore import Namespace, Store
from kvstore.codecs import warm
from kvstore.codecs.warm import WarmMemory

MiB = 1 << 20
NS = Namespace(model_id="warm", config_fingerprint="test")


@pytest.fixture
def policy(monkeypatch: pytest.MonkeyPatch) -> Iterator[WarmMemory]:
    """A fresh policy in place of the process's, MLX's cache limit as it was afterwards."""
    before = mx.set_cache_limit(32 * MiB)
    mx.set_cache_limit(before)
    p = WarmMemory(idle_seconds=60.0)
    monkeypatch.setattr(warm, "POLICY", p)
    yield p
    p.give_back()
    mx.set_cache_limit(before)


def _limit() -> int:
    now = mx.set_cache_limit(0)
    mx.set_cache_limit(now)
    return now


def test_one_restore_changes_nothing_the_second_raises_a_bounded_limit(
    policy: WarmMemory,
) -> None:
    start = _limit()
    policy.restoring(100 * MiB)
    assert _limit() == start and policy.state.raised_to == 0
    policy.restoring(80 * MiB)  # the largest recent restore sets it, plus a quarter
    assert _limit() == 125 * MiB == policy.state.raised_to
    policy.cap = 64 * MiB
    policy.restoring(200 * MiB)  # never above the cap
    assert _limit() == 125 * MiB
    policy.give_back()
    assert _limit() == start and policy.state.given_back == 1


def test_a_higher_limit_set_by_the_user_is_kept(policy: WarmMemory) -> None:
    mx.set_cache_limit(1 << 30)
    policy.restoring(10 * MiB)
    policy.restoring(10 * MiB)
    assert _limit() == 1 << 30 and policy.state.raised_to == 0


def test_idle_gives_the_memory_back(policy: WarmMemory) -> None:
    start = _limit()
    policy.idle_seconds = 0.2
    policy.restoring(64 * MiB)
    policy.restoring(64 * MiB)
    assert _limit() == 80 * MiB
    deadline = time.monotonic() + 5
    while policy.state.given_back == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert policy.state.given_back == 1 and _limit() == start


def test_short_of_memory_keeps_nothing_warm(policy: WarmMemory) -> None:
    start = _limit()
    policy.restoring(64 * MiB)
    policy.restoring(64 * MiB)
    assert _limit() == 80 * MiB
    policy.low_memory = 1.0  # every machine is short of all its memory
    policy.restoring(64 * MiB)
    assert _limit() == start and policy.state.refused_low_memory == 1


def _cache(tokens: int) -> list[object]:
    from mlx_lm.models.cache import KVCache

    cache = []
    for i in range(4):
        c = KVCache()
        kv = mx.random.normal((1, 8, tokens, 128), key=mx.random.key(i)).astype(mx.bfloat16)
        c.update_and_fetch(kv, kv + 1)
        cache.append(c)
    mx.eval([c.keys for c in cache])
    return cache


def test_repeated_restores_reuse_their_memory(policy: WarmMemory, tmp_path: Path) -> None:
    """64 MiB a restore (twice MLX's default cache): from the third restore on, its
    arrays come from the buffers the one before gave back, not from fresh pages."""
    tokens = list(range(4096))
    with Store.open(tmp_path / "root", namespace=NS, durable=False) as store:
        cache = _cache(len(tokens))
        store.save(tokens, cache)
        want = [mx.array(c.keys) for c in cache]  # type: ignore[attr-defined]
        del cache
        faults = []
        for _ in range(4):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            got, n = store.restore(tokens)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            assert n == len(tokens) and got is not None
            for c, w in zip(got, want, strict=True):
                assert mx.array_equal(c.keys[..., : len(tokens), :], w).item()
            del got
    pages = (64 * MiB) // 4096
    assert policy.state.restores == 4 and policy.state.raised_to >= 64 * MiB
    assert max(faults[2:]) < pages // 10, faults


def test_restores_share_one_watcher_thread_and_push_its_deadline(policy: WarmMemory) -> None:
    """A restore starts no thread of its own (that cost each restore about 0.5 ms before its
    first read): one watcher sleeps until the last restore's idle deadline."""
    policy.idle_seconds = 0.3
    policy.restoring(64 * MiB)
    policy.restoring(64 * MiB)
    watcher = policy._watcher
    assert watcher is not None and watcher.is_alive()
    started = threading.active_count()
    for _ in range(6):  # 0.6 s of restores, each within the idle time of the one before
        time.sleep(0.1)
        policy.restoring(64 * MiB)
        assert threading.active_count() <= started
    assert policy._watcher is watcher and policy.state.given_back == 0
    watcher.join(5)
    assert not watcher.is_alive() and policy.state.given_back == 1
