"""PersistentPromptCache per request (issue 28): the tier that gave each request its
reused tokens, the miss reason, the request record and its log line, and the write
cost of a conversation's snapshots (deferred partial blocks)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import arrays_cache
from helpers.kv import two_layer_kv
from helpers.observers import Seen
from helpers.stores import SlowStore

import kvstore
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.mlx_lm import requests as R
from kvstore.tiny import make_tiny_model

T = 16  # block_tokens of the roots here
BPT = 2 * 2 * 2 * 8 * 4  # bytes per token of _kv: 2 layers, keys+values, 2 heads, dim 8, fp32


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, None, None]:
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "llama", "llama")
    return (str(model), None, None)  # the key mlx-lm's server passes


@pytest.fixture
def store(tmp_path: Path) -> Iterator[kvstore.Store]:
    with kvstore.Store.open(tmp_path / "root", durable=False, block_tokens=T) as s:
        yield s




def _seen(ppc: PersistentPromptCache) -> Seen:
    seen = Seen()
    ppc.observers.append(seen)
    return seen


def _fields(line: str) -> dict[str, str]:
    head, _, rest = line.partition(" request ")
    assert head == "kvstore"
    return dict(kv.split("=", 1) for kv in rest.split(" "))


def test_each_request_counts_the_tier_that_gave_its_tokens(
    store: kvstore.Store, key: Any
) -> None:
    a = list(range(100, 200))
    reply = list(range(900, 910))
    b = a + reply + list(range(300, 320))
    ppc = PersistentPromptCache(store, min_tokens=16)
    seen = _seen(ppc)
    cache, rest = ppc.fetch_nearest_cache(key, a)  # nothing anywhere
    assert cache is None and rest == a
    ppc.insert_cache(key, a + reply, two_layer_kv(a + reply))  # the reply: queued (new blocks)
    assert ppc.drain(30)
    cache, rest = ppc.fetch_nearest_cache(key, b)  # memory holds a + reply
    assert len(b) - len(rest) == 110
    cold = PersistentPromptCache(store)  # a restarted server: the store answers
    cache, rest = cold.fetch_nearest_cache(key, b)
    assert len(b) - len(rest) == 110
    c = store.usage().lifetime
    assert (c.requests, c.prompt_tokens) == (3, 100 + 130 + 130)
    assert (c.memory_requests, c.memory_tokens) == (1, 110)
    assert (c.local_requests, c.local_tokens) == (1, 110)
    assert (c.remote_requests, c.misses, c.miss_reasons) == (0, 1, {"no_entry": 1})
    mine = ppc.request_counts()
    assert (mine.requests, mine.memory_tokens, mine.local_tokens) == (2, 110, 0)
    assert cold.request_counts().local_tokens == 110
    first, second = seen.opened
    assert (first.tier, first.reused_tokens, first.miss) == (None, 0, "no_entry")
    assert (second.tier, second.reused_tokens, second.miss) == ("memory", 110, None)
    assert seen.done == [first]  # the reply's insert finished the first request
    assert _fields(first.line()) == {
        "id": "1", "model": "llama", "prompt": "100", "reused": "0", "source": "none",
        "memory": "0", "local": "0", "remote": "0", "computed": "100",
        "restore_ms": f"{first.restore_seconds * 1e3:.1f}", "miss": "no_entry",
        "saves_queued": "1", "saves_deferred": "0", "reply": "queued",
        "rewrites": "-", "shared": "0", "part": "-", "part_msg": "-", "part_role": "-",
        "part_block": "-", "part_matched": "-",
    }
    ppc.close()
    cold.close()
    assert [r.id for r in seen.done] == [1, 2]  # close finishes the open one
    assert seen.done[1].reply == "none"


def test_segment_ends_count_for_their_request_and_short_replies_are_named(
    store: kvstore.Store, key: Any
) -> None:
    system = list(range(1, 41))
    prompt = system + list(range(500, 510))
    ppc = PersistentPromptCache(store, min_tokens=45, defer_seconds=0)
    seen = _seen(ppc)
    ppc.fetch_nearest_cache(key, prompt)
    ppc.insert_cache(key, system, two_layer_kv(system), cache_type="system")  # under min_tokens
    ppc.insert_cache(key, prompt[:48], two_layer_kv(prompt[:48]), cache_type="user")
    assert seen.done == []
    ppc.insert_cache(key, prompt + [7, 8], two_layer_kv(prompt + [7, 8]))
    (rec,) = seen.done
    assert (rec.saves_queued, rec.saves_deferred, rec.reply) == (2, 0, "queued")
    ppc.fetch_nearest_cache(key, list(range(2000, 2010)))
    ppc.insert_cache(key, list(range(2000, 2012)), two_layer_kv(list(range(2000, 2012))))
    assert seen.done[1].reply == "short" and seen.done[1].saves_queued == 0
    ppc.close()


def test_requests_that_never_insert_are_finished_in_bounded_numbers(
    store: kvstore.Store, key: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(R, "OPEN_MAX", 2)
    ppc = PersistentPromptCache(store)
    seen = _seen(ppc)
    for i in range(4):
        ppc.fetch_nearest_cache(key, [i + 1] * 5)
    assert [(r.id, r.reply) for r in seen.done] == [(1, "none"), (2, "none")]
    ppc.close()


def test_a_load_that_fails_verification_is_the_miss_reason(
    store: kvstore.Store, key: Any, tmp_path: Path
) -> None:
    a = list(range(100, 140))
    ppc = PersistentPromptCache(store, min_tokens=16)
    ppc.insert_cache(key, a, two_layer_kv(a))
    assert ppc.drain(30)
    (e,) = store.entries()
    d = store.manifest(e.id).token_blocks[1].hex()
    path = tmp_path / "root" / "blocks" / d[:2] / d
    data = bytearray(path.read_bytes())
    data[len(data) // 2 + 3] ^= 0x10
    path.write_bytes(bytes(data))
    cold = PersistentPromptCache(store)
    seen = _seen(cold)
    cache, rest = cold.fetch_nearest_cache(key, a + [5])
    assert cache is None and (seen.opened[0].miss, seen.opened[0].tier) == ("verify_failed", None)
    assert store.usage().lifetime.miss_reasons == {"verify_failed": 1}
    assert store.counters.values().corrupt_blocks == 1
    ppc.close()
    cold.close()


# --- write cost --------------------------------------------------------------------


def _conversation(ppc: PersistentPromptCache, key: Any, lengths: list[int]) -> None:
    """One conversation growing turn by turn: each snapshot extends the previous one."""
    toks = list(range(1000, 1000 + max(lengths)))
    for n in lengths:
        ppc.insert_cache(key, toks[:n], two_layer_kv(toks[:n]))


@pytest.mark.parametrize(("defer", "written", "saved", "superseded"),
                         [(300.0, 40 + 38 + 11, 3, 2), (0.0, 40 + 11 + 15 + 38 + 11, 5, 0)])
def test_a_conversation_writes_its_partial_last_block_once(
    store: kvstore.Store, key: Any, defer: float, written: int, saved: int, superseded: int
) -> None:
    """40 tokens (two blocks and 8), then 43, 47 (inside the same block: deferred, each
    replacing the last), 70 (two new blocks: written at once), 75 (deferred until close).
    Deferred: 40 + (70 - 32) + (75 - 64) tokens written; at once: every partial block again."""
    ppc = PersistentPromptCache(store, min_tokens=16, defer_seconds=defer)
    seen = _seen(ppc)
    _conversation(ppc, key, [40, 43, 47, 70, 75])
    st = ppc.persist_stats()
    assert st.deferred == (1 if defer else 0) and st.superseded == superseded
    assert ppc.close(30)
    st = ppc.persist_stats()
    assert (st.saved, st.failed, st.deferred) == (saved, 0, 0)
    assert st.bytes_written == written * BPT
    assert st.kv_bytes_added == 75 * BPT  # the final conversation's own KV bytes
    assert st.write_amplification == pytest.approx(written / 75)
    assert sorted(e.n_tokens for e in store.entries()) == (
        [40, 70, 75] if defer else [40, 43, 47, 70, 75])
    assert sum(s.new_bytes for s in seen.saves) == written * BPT
    cache, n = store.restore(list(range(1000, 1075)) + [1],
                             namespace=ppc.namespace_for(key))
    assert n == 75  # after close the whole conversation is on disk either way


def test_a_deferred_snapshot_is_written_after_defer_seconds(
    store: kvstore.Store, key: Any
) -> None:
    ppc = PersistentPromptCache(store, min_tokens=16, defer_seconds=0.3)
    _conversation(ppc, key, [40, 45])
    deadline = time.monotonic() + 10
    while ppc.saved < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ppc.persist_stats().deferred == 0
    assert sorted(e.n_tokens for e in store.entries()) == [40, 45]
    ppc.close()


def test_deferred_snapshots_count_against_the_queue_bytes_and_go_first(
    store: kvstore.Store, key: Any
) -> None:
    one = sum(c.nbytes for c in two_layer_kv(list(range(45))))
    slow = SlowStore(store)
    ppc = PersistentPromptCache(slow, min_tokens=16, queue_bytes=int(2.5 * one))  # type: ignore[arg-type]
    a, b = list(range(1000, 1045)), list(range(3000, 3045))
    ppc.insert_cache(key, a[:40], two_layer_kv(a[:40]))  # the worker holds it, at the gate
    assert slow.entered.wait(30)
    ppc.insert_cache(key, a, two_layer_kv(a))  # deferred
    ppc.insert_cache(key, b[:40], two_layer_kv(b[:40]))  # queued
    ppc.insert_cache(key, b, two_layer_kv(b))  # deferred: over the cap, so a's deferred one goes
    st = ppc.persist_stats()
    assert (st.deferred, st.dropped, st.pending) == (1, 1, 2)
    slow.gate.set()
    assert ppc.drain(30)
    held = sorted((e.n_tokens, store.manifest(e.id).tokens[:4]) for e in store.entries())
    assert [n for n, _ in held] == [40, 40, 45]
    assert held[-1][1] == (3000).to_bytes(4, "little")  # b's: a's deferred one was dropped
    assert ppc.persist_stats().saved == 3
    ppc.close()


def test_caches_that_cannot_be_trimmed_are_never_deferred(
    store: kvstore.Store, key: Any
) -> None:
    ppc = PersistentPromptCache(store, min_tokens=16)
    toks = list(range(1000, 1050))
    for n in (40, 45):
        ppc.insert_cache(key, toks[:n], two_layer_kv(toks[:n]) + [arrays_cache(n)])
    assert ppc.persist_stats().deferred == 0
    assert ppc.drain(30) and ppc.saved == 2
    ppc.close()


def test_a_reply_is_replaced_by_its_next_turn_but_not_by_another_user(
    store: kvstore.Store, key: Any
) -> None:
    """The next turn re-renders the reply (other tokens than generated): it still replaces
    the reply's deferred snapshot, since it starts with that request's prompt; another
    user's request, sharing only the stored system prompt, replaces nothing."""
    system = list(range(1000, 1040))  # two blocks and 8: written at once
    ppc = PersistentPromptCache(store, min_tokens=16)
    ppc.insert_cache(key, system, two_layer_kv(system), cache_type="system")
    p_a, p_b = system + [7, 8], system + [9, 10]
    for p in (p_a, p_b):
        ppc.fetch_nearest_cache(key, p)
        ppc.insert_cache(key, p + [1, 2, 3], two_layer_kv(p + [1, 2, 3]))  # deferred replies
    p_a2 = p_a + [4, 5] + [11]  # the reply as the template renders it, then the user
    ppc.fetch_nearest_cache(key, p_a2)
    ppc.insert_cache(key, p_a2 + [6], two_layer_kv(p_a2 + [6]))
    st = ppc.persist_stats()
    assert (st.deferred, st.superseded) == (2, 1)
    assert ppc.close(30)
    assert sorted(e.n_tokens for e in store.entries()) == [40, 45, 46]
    by_len = {e.n_tokens: store.manifest(e.id).tokens for e in store.entries()}
    assert by_len[45][4 * 40:4 * 42] == bytes([9, 0, 0, 0, 10, 0, 0, 0])  # b's reply stays
