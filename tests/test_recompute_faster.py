"""Issue 37: never a hit slower than a miss. The prompt cache restores a stored prefix
only when its measured rates predict the restore faster than the prefill; otherwise
the request computes it, counted with the miss reason ``recompute_faster``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.kv import two_layer_kv
from helpers.observers import Seen

import kvstore
from kvstore.mlx_lm import PersistentPromptCache, crossover
from kvstore.tiny import make_tiny_model

T = 16


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, None, None]:
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "llama", "llama")
    return (str(model), None, None)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[kvstore.Store]:
    with kvstore.Store.open(tmp_path / "root", durable=False, block_tokens=T) as s:
        yield s




A = list(range(100, 200))
REPLY = list(range(900, 910))
B = A + REPLY + list(range(300, 320))


def _stored(store: kvstore.Store, key: Any) -> None:
    ppc = PersistentPromptCache(store, min_tokens=16)
    ppc.insert_cache(key, A + REPLY, two_layer_kv(A + REPLY))
    assert ppc.drain(30)


def test_the_choice_follows_the_measured_rates_both_ways(store: kvstore.Store,
                                                        key: Any) -> None:
    _stored(store, key)
    # unmeasured: seeded conservatively, the store is used as before, and measured
    first = PersistentPromptCache(store)
    cache, rest = first.fetch_nearest_cache(key, B)
    assert cache is not None and len(B) - len(rest) == 110
    ns = first.namespace_for(key)
    assert first.throughputs.restore_bps["local"] > 0
    assert first.throughputs.bytes_per_token[ns] >= 2 * 2 * 2 * 8 * 4  # KV bytes a token
    assert first.throughputs.prefill_tps is None

    # a slow restore (1 kB/s, 1 kB a token) against a fast prefill: computed instead
    slow = PersistentPromptCache(store)
    seen = Seen()
    slow.observers.append(seen)
    slow.throughputs.note_restore("local", ns, 1000, 1, 1.0)
    slow.throughputs.note_prefill(1000, 1.0)
    pred = slow.throughputs.predict("local", ns, 110, 110)
    assert pred is not None and pred.recompute and pred.restore_s == pytest.approx(110.0)
    cache, rest = slow.fetch_nearest_cache(key, B)
    assert cache is None and rest == B
    assert [(r.tier, r.reused_tokens, r.miss) for r in seen.opened] == [
        (None, 0, "recompute_faster")]
    assert "miss=recompute_faster" in seen.opened[0].line()
    assert slow.persist_stats().recomputed == 1
    assert slow.request_counts().miss_reasons == {"recompute_faster": 1}
    assert store.usage().lifetime.miss_reasons == {"recompute_faster": 1}

    # a fast restore against a slow prefill (1 token/s): restored
    fast = PersistentPromptCache(store)
    fast.throughputs.note_restore("local", ns, 10**9, 1, 1e-3)
    fast.throughputs.note_prefill(16, 16.0)
    cache, rest = fast.fetch_nearest_cache(key, B)
    assert cache is not None and len(B) - len(rest) == 110
    assert fast.persist_stats().recomputed == 0
    c = store.usage().lifetime
    assert (c.local_requests, c.local_tokens, c.miss_reasons) == (2, 220,
                                                                  {"recompute_faster": 1})


def test_one_skipped_restore_in_probe_every_is_restored_and_measured(
        store: kvstore.Store, key: Any) -> None:
    _stored(store, key)
    ppc = PersistentPromptCache(store)
    ns = ppc.namespace_for(key)
    ppc.throughputs.note_restore("local", ns, 1000, 1, 1.0)
    ppc.throughputs.note_prefill(1000, 1.0)
    got = [ppc.fetch_nearest_cache(key, B)[0] is not None
           for _ in range(crossover.PROBE_EVERY)]
    assert got == [False] * (crossover.PROBE_EVERY - 1) + [True]
    assert ppc.persist_stats().recomputed == crossover.PROBE_EVERY - 1
    assert ppc.throughputs.restore_bps["local"] > 1000  # the probe's rate was averaged in


def test_the_prefill_rate_is_measured_from_fetch_to_the_prompts_snapshot(
        store: kvstore.Store, key: Any) -> None:
    ppc = PersistentPromptCache(store, min_tokens=16)
    cache, rest = ppc.fetch_nearest_cache(key, B)  # nothing stored: all computed
    assert cache is None
    time.sleep(0.2)
    ppc.insert_cache(key, B[:-1], two_layer_kv(B[:-1]))  # the prompt's end, as serve hands it over
    tps = ppc.throughputs.prefill_tps
    assert tps is not None and 0 < tps <= (len(B) - 1) / 0.2
    ppc.insert_cache(key, B + [1, 2], two_layer_kv(B + [1, 2]))  # the reply: not a prefill
    assert ppc.throughputs.prefill_tps == tps
    assert ppc.drain(30)


def test_a_memory_hit_that_copies_a_whole_cache_for_a_few_tokens_is_computed_instead(
        store: kvstore.Store, key: Any) -> None:
    # memory holds a long conversation; the request shares only its first 9 tokens (a
    # different conversation after them): the hit would hand out the whole entry's arrays,
    # trimmed, and its first step would copy all of them to reuse 9 tokens
    long = list(range(5000, 5400))
    other = long[:9] + list(range(7000, 7040))
    ppc = PersistentPromptCache(store, min_tokens=10**6)  # memory only: the store is empty
    ppc.insert_cache(key, long, two_layer_kv(long))
    seen = Seen()
    ppc.observers.append(seen)
    # a slow copy (1 kB/s) against a fast prefill (1000 tokens/s): computed instead
    ppc.throughputs.note_copy(1000, 1.0)
    ppc.throughputs.note_prefill(1000, 1.0)
    nbytes = crossover.cache_nbytes(two_layer_kv(long))
    pred = ppc.throughputs.predict_copy(nbytes, 9)
    assert pred is not None and pred.recompute
    cache, rest = ppc.fetch_nearest_cache(key, other)
    assert cache is None and rest == other
    assert [(r.tier, r.reused_tokens, r.miss) for r in seen.opened] == [
        (None, 0, "recompute_faster")]
    assert ppc.persist_stats().recomputed == 1
    assert ppc.request_counts().miss_reasons == {"recompute_faster": 1}
    # the same request whose whole prompt the entry holds: its copy saves 400 tokens' prefill
    ppc.throughputs.copy_bps = float(nbytes)  # a second to copy it all, 0.4 s of prefill saved
    cache, rest = ppc.fetch_nearest_cache(key, long + [1])
    assert cache is None  # still dearer: copied at 1 entry/s against 1000 tokens/s
    # a fast copy: the memory hit is taken, for 9 tokens too
    ppc.throughputs.copy_bps = nbytes * 1000.0
    cache, rest = ppc.fetch_nearest_cache(key, other)
    assert cache is not None and rest == other[9:]
    assert ppc.persist_stats().recomputed == 2


def test_the_copy_rate_is_measured_once_a_process_before_a_memory_hit_is_judged(
        store: kvstore.Store, key: Any) -> None:
    long = list(range(5000, 5400))
    ppc = PersistentPromptCache(store, min_tokens=10**6)
    ppc.insert_cache(key, long, two_layer_kv(long))
    cache, _ = ppc.fetch_nearest_cache(key, long[:9] + [1, 2])
    assert cache is not None and ppc.throughputs.copy_bps is None  # no prefill rate yet
    ppc.throughputs.note_prefill(1000, 1.0)
    cache, _ = ppc.fetch_nearest_cache(key, long[:9] + [1, 2])
    assert cache is not None  # this machine copies far faster than 1000 tokens a second
    assert ppc.throughputs.copy_bps is not None and ppc.throughputs.copy_bps > 1e6
