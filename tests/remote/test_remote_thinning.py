"""The remote keeps what a checkpoint is (issue 26 on the remote tier): a pull keeps an
entry's priority, a checkpoint's too, and the remote's compaction thins checkpoints in the
root's order (kvstore.catalog.thinning) before it evicts any other entry, however old."""

from __future__ import annotations

import time
from pathlib import Path

from helpers.kv import T, hybrid_cache, make_cache, matches, open_store, tokens_for

STATE = 64 * 64 * 4  # the bytes of one checkpoint's own state (hybrid_cache)


def test_a_pull_keeps_every_priority_a_checkpoint_too(tmp_path: Path, url: str) -> None:
    toks = tokens_for(30, 3 * T + 1)
    with open_store(tmp_path / "a", remote=url) as a:
        want = {
            a.save(toks[:T], hybrid_cache(toks[:T]), priority="checkpoint").id: "checkpoint",
            a.save(toks[: 2 * T], make_cache(toks[: 2 * T]), priority="system").id: "system",
            a.save(toks, make_cache(toks), priority="user").id: "user",
        }
        assert a.push(60).entries == 3
    with open_store(tmp_path / "b", remote=url) as b:
        assert len(b.pull().pulled) == 3
        assert {e.id: e.priority for e in b.entries()} == want


def test_remote_compaction_thins_checkpoints_before_anything_else(tmp_path: Path,
                                                                  url: str) -> None:
    doc = list(range(100, 100 + 8 * 4 * T))
    with open_store(tmp_path / "a", remote=url) as a:
        old = tokens_for(31, 4 * T)
        old_id = a.save(old, make_cache(old), priority="assistant").id
        assert a.push(60).entries == 1
        time.sleep(1.1)  # LastModified has one-second resolution: the oldest entry
        ids: dict[str, str] = {}
        for k in range(1, 9):  # a checkpoint every 4 blocks, as prefill saves them
            n = 4 * T * k
            ids[f"d{k}"] = a.save(doc[:n], hybrid_cache(doc[:n]), priority="checkpoint",
                                  reuse_prefix=True).id
        assert a.push(60).entries == 8
        names = {v: k for k, v in ids.items()} | {old_id: "old"}
        r = a.remote
        assert r is not None
        live = r.compact(grace=3600, dry_run=True).live_bytes
        # room for all but four checkpoints' states: the four at odd multiples of 4T go
        dry = r.compact(max_bytes=live - 4 * STATE, grace=0, dry_run=True)
        assert sorted(names[e] for e in dry.evicted) == ["d1", "d3", "d5", "d7"]
        done = r.compact(max_bytes=live - 4 * STATE, grace=0)
        assert done.evicted == dry.evicted and done.bytes_deleted == 4 * STATE
        # then the next level (d2, d6), then d4, then the deepest; the oldest entry last
        done = r.compact(max_bytes=live - 7 * STATE, grace=0)
        order = [names[e] for e in done.evicted]
        assert sorted(order[:2]) == ["d2", "d6"] and order[2:] == ["d4"]
        assert {names[e.id] for e in r.entries()} == {"d8", "old"}
        assert r.verify(read_data=True).sound
    with open_store(tmp_path / "b", remote=url) as b:  # what is left restores
        cache, n = b.restore(doc + [7])
        assert n == len(doc) and cache is not None  # the deepest checkpoint
        cache, n = b.restore(old)
        assert n == len(old) and cache is not None and matches(cache, old, n)


def test_remote_compaction_takes_the_other_entries_as_mlx_lm_does(tmp_path: Path,
                                                                   url: str) -> None:
    """After the checkpoints, mlx-lm's ``CacheOrder`` as the root's compaction takes it:
    one least-recently-used queue per priority, the lowest class first while its queue is
    as long as the next one's. Recency alone would evict the old system prompt first."""
    with open_store(tmp_path / "a", remote=url) as a:
        names: dict[str, str] = {}
        for i, prio in enumerate(["system", "user", "assistant"]):
            if i:
                time.sleep(1.1)  # LastModified has one-second resolution
            toks = tokens_for(40 + i, 2 * T)
            names[a.save(toks, make_cache(toks), priority=prio).id] = prio
            assert a.push(60).entries == 1
        r = a.remote
        assert r is not None
        order = []
        for _ in range(3):
            live = r.compact(grace=3600, dry_run=True).live_bytes
            done = r.compact(max_bytes=live - 1, grace=0)
            order += [names[e] for e in done.evicted]
        assert order == ["assistant", "user", "system"]
        assert list(r.entries()) == []
