"""PersistentPromptCache and checkpoints (issue 26): a checkpoint goes to the store, never
into mlx-lm's in-memory LRU; at most one waits in the write-behind queue; and a lookup
finds one the writer has not reached yet."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

import kvstore
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.mlx_lm.prefill import checkpoint_type, parse_checkpoint_type

KEY = ("model", None, None)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[kvstore.Store]:
    with kvstore.Store.open(tmp_path / "root", durable=False) as s:
        yield s


def _hybrid(tokens: list[int]) -> list[Any]:
    """An attention layer whose rows follow the tokens, and an SSM-like state of the last."""
    kv = KVCache()
    t = mx.array(tokens, dtype=mx.float32).reshape(1, 1, len(tokens), 1)
    k = mx.broadcast_to(t, (1, 2, len(tokens), 8))
    kv.update_and_fetch(k, -k)
    ssm = ArraysCache(2)
    ssm[0] = mx.full((1, 3, 4), float(tokens[-1]))
    ssm[1] = mx.full((1, 2, 4, 4), float(len(tokens)))
    mx.eval(kv.keys, kv.values, ssm[0], ssm[1])
    return [kv, ssm]


def _cache(store: kvstore.Store) -> PersistentPromptCache:
    pc = PersistentPromptCache(store, min_tokens=16)
    pc.register_model(KEY, nn.Linear(4, 4), model_id="ckpt")
    return pc


def test_checkpoint_types_round_trip() -> None:
    t = checkpoint_type("0123456789abcdef", 4000, 1024)
    assert parse_checkpoint_type(t) == {"cache_type": "checkpoint",
                                        "conversation": "0123456789abcdef",
                                        "prompt_tokens": "4000", "checkpoint_every": "1024"}
    assert parse_checkpoint_type("checkpoint") == {"cache_type": "checkpoint"}
    for other in ("user", "assistant", "system", "checkpoint:x:y:z", "checkpoint:a:1"):
        assert parse_checkpoint_type(other) is None


def test_a_checkpoint_goes_to_the_store_only(store: kvstore.Store) -> None:
    pc = _cache(store)
    tokens = list(range(100, 164))
    pc.insert_cache(KEY, tokens, _hybrid(tokens), cache_type=checkpoint_type("ab", 90, 64))
    pc.insert_cache(KEY, tokens[:40], _hybrid(tokens[:40]), cache_type="system")
    assert pc.drain(30) and pc.saved == 2
    assert len(pc) == 1 and pc.stats_by_type()["system"]["n_sequences"] == 1  # not the checkpoint
    (entry,) = [e for e in store.entries() if e.priority == "checkpoint"]
    assert entry.n_tokens == 64
    assert store.manifest(entry.id).metadata == {
        "cache_type": "checkpoint", "conversation": "ab", "prompt_tokens": "90",
        "checkpoint_every": "64"}
    # a later prompt that diverges after it restores it from the store
    cache, rest = pc.fetch_nearest_cache(KEY, tokens + [7, 8, 9])
    assert cache is not None and rest == [7, 8, 9] and cache[0].offset == 64
    pc.close()


class _Gate:
    """Holds the writer inside ``Store.save`` until released."""

    def __init__(self, store: kvstore.Store, mp: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        save = store.save

        def held(*a: Any, **kw: Any) -> Any:
            self.entered.set()
            assert self.release.wait(30)
            return save(*a, **kw)

        mp.setattr(store, "save", held)


def test_a_waiting_checkpoint_is_found_and_the_next_one_waits_its_turn(
    store: kvstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate(store, monkeypatch)
    pc = _cache(store)
    t = list(range(1, 200))
    pc.insert_cache(KEY, t[:50], _hybrid(t[:50]), cache_type="system")  # the writer holds it
    assert gate.entered.wait(30)
    pc.insert_cache(KEY, t[:64], _hybrid(t[:64]), cache_type="checkpoint")  # queued
    # not on disk yet, and not in memory: found in the queue all the same
    cache, rest = pc.fetch_nearest_cache(KEY, t[:100])
    assert cache is not None and rest == t[64:100]
    assert mx.array_equal(cache[1][1], mx.full((1, 2, 4, 4), 64.0)).item()
    third = threading.Thread(
        target=pc.insert_cache, args=(KEY, t[:128], _hybrid(t[:128])),
        kwargs={"cache_type": "checkpoint"})
    third.start()
    time.sleep(0.3)
    assert third.is_alive()  # one checkpoint waits already: this one waits for the writer
    gate.release.set()
    third.join(30)
    assert not third.is_alive()
    assert pc.drain(30) and pc.saved == 3 and pc.dropped == 0
    assert sorted(e.n_tokens for e in store.entries() if e.priority == "checkpoint") == [64, 128]
    pc.close()


def test_a_tenants_waiting_checkpoint_is_found_by_that_tenant_alone(
    store: kvstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate(store, monkeypatch)
    pc = _cache(store)
    t = list(range(1, 200))
    pc.set_tenant("tenant-a")
    pc.insert_cache(KEY, t[:50], _hybrid(t[:50]), cache_type="system")  # the writer holds it
    assert gate.entered.wait(30)
    pc.insert_cache(KEY, t[:64], _hybrid(t[:64]), cache_type="checkpoint")  # queued
    cache, rest = pc.fetch_nearest_cache(KEY, t[:100])
    assert cache is not None and rest == t[64:100]  # the same salt: found in the queue
    pc.set_tenant("tenant-b")
    cache, rest = pc.fetch_nearest_cache(KEY, t[:100])
    assert cache is None and rest == t[:100]  # another salt: never
    gate.release.set()
    assert pc.drain(30) and pc.saved == 2
    pc.close()


def test_a_checkpoint_is_never_deferred_nor_replaces_a_deferred_snapshot(
    store: kvstore.Store,
) -> None:
    """Issue 28's write-behind keeps a snapshot that adds no whole block in memory (deferred)
    and drops it for its conversation's next one. A checkpoint is written at once, with
    priority 'checkpoint', even for a cache that can be trimmed, and the deferred snapshot
    it extends stays deferred (it is not superseded by a checkpoint)."""
    pc = PersistentPromptCache(store, min_tokens=16, defer_seconds=300)
    pc.register_model(KEY, nn.Linear(4, 4), model_id="ckpt")
    t = list(range(1, 120))  # under one block of 256: nothing here adds a whole block
    pc.insert_cache(KEY, t[:40], _hybrid(t[:40])[:1], cache_type="user")
    assert pc.persist_stats().deferred == 1
    pc.insert_cache(KEY, t[:100], _hybrid(t[:100])[:1], cache_type="checkpoint")
    deadline = time.monotonic() + 30
    while pc.saved < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    st = pc.persist_stats()
    assert (st.saved, st.deferred, st.superseded) == (1, 1, 0)
    assert [(e.n_tokens, e.priority) for e in store.entries()] == [(100, "checkpoint")]
    assert pc.drain(30) and pc.saved == 2
    assert sorted((e.n_tokens, e.priority) for e in store.entries()) == [
        (40, "user"), (100, "checkpoint")]
    pc.close()


def test_a_checkpoint_counts_among_its_requests_saves(store: kvstore.Store) -> None:
    """kvstore serve's request log: a checkpoint cut inside a request's prompt is one of the
    snapshots that request queued (saves_queued), its reply another."""
    from kvstore.mlx_lm.requests import CacheObserver, RequestRecord

    class Done(CacheObserver):
        def __init__(self) -> None:
            self.done: list[RequestRecord] = []

        def finished(self, rec: RequestRecord) -> None:
            self.done.append(rec)

    pc = _cache(store)
    seen = Done()
    pc.observers.append(seen)
    prompt = list(range(1, 150))
    pc.fetch_nearest_cache(KEY, prompt)
    pc.insert_cache(KEY, prompt[:64], _hybrid(prompt[:64]),
                    cache_type=checkpoint_type("ab", len(prompt), 64))
    pc.insert_cache(KEY, prompt[:128], _hybrid(prompt[:128]),
                    cache_type=checkpoint_type("ab", len(prompt), 64))
    assert seen.done == []  # checkpoints never finish their request
    pc.insert_cache(KEY, [*prompt, 7], _hybrid([*prompt, 7]))
    (rec,) = seen.done
    assert (rec.saves_queued, rec.saves_deferred, rec.reply) == (3, 0, "queued")
    assert pc.drain(30) and pc.saved == 3
    pc.close()


def test_a_shallow_hit_says_so_while_the_deeper_snapshot_waits_to_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second question about a shared document restores the last checkpoint before the
    question; the first question's own snapshot shares more of the document but cannot be
    cut back to it, so the request's miss reason is ``shallow``, whether that snapshot is
    on disk yet or still waiting in the write-behind queue (``kvstore serve``'s log said
    ``miss=-`` whenever the second question came before the writer reached it)."""
    from helpers.observers import Seen

    with kvstore.Store.open(tmp_path / "root", durable=False, block_tokens=16) as store:
        pc = _cache(store)
        seen = Seen()
        pc.observers.append(seen)
        doc = list(range(1, 91))  # 90 tokens: 5 whole blocks of 16
        first, second = [*doc, 500, 501, 502], [*doc, 600, 601, 602]
        pc.insert_cache(KEY, doc[:64], _hybrid(doc[:64]), cache_type="checkpoint")
        assert pc.drain(30) and pc.saved == 1
        gate = _Gate(store, monkeypatch)
        pc.insert_cache(KEY, first, _hybrid(first))  # the first question's end: held
        assert gate.entered.wait(30)
        for _ in range(2):  # while it waits, then once it is on disk
            cache, rest = pc.fetch_nearest_cache(KEY, second)
            assert cache is not None and rest == second[64:]
            rec = seen.opened[-1]
            assert (rec.reused_tokens, rec.tier, rec.miss, rec.shared) == (64, "local",
                                                                           "shallow", 90)
            gate.release.set()
            assert pc.drain(30) and pc.saved == 2
        assert pc.request_counts().partial_reasons == {"shallow": 2}
        pc.close()
