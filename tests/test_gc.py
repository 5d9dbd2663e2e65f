"""Refcounts, totals, compact (grace, orphans, temps) and the byte budget."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from helpers.kv import make_cache, matches, open_store, recount, sound_store, tokens_for
from mlx_lm.models.cache import LRUPromptCache

import kvstore
from kvstore.index import EntryRecord, RefInfo
from kvstore.local.catalog import delete_plan
from kvstore.local.gc import EvictionOrder, plan_budget, plan_compact

BLOCK = 16 * 2 * 2 * 8 * 2  # one full token block: 16 tokens, K+V, H2 D8 fp16


def save(s: kvstore.Store, seed: int, n: int, shared: int = 0, **kw: object) -> list[int]:
    toks = tokens_for(seed, n, shared)
    s.save(toks, make_cache(toks), **kw)  # type: ignore[arg-type]
    time.sleep(0.002)  # access stamps are in ms: keep the LRU order of saves unambiguous
    return toks


def stored_refs(s: kvstore.Store) -> dict[bytes, RefInfo]:
    with s.local.index.read() as txn:
        return dict(s.local.index.iter_refs(txn))


def test_refcounts_and_totals_stay_exact(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    toks = [save(s, i, 100 + 10 * i, shared=64) for i in range(6)]
    refs = stored_refs(s)
    assert {d: r.refcount for d, r in refs.items()} == recount(s)
    shared = [d for d, r in refs.items() if r.refcount == 6]
    assert len(shared) == 4  # 64 shared tokens = 4 full blocks, stored once
    for t in toks[:3]:
        m = s.lookup(t)
        assert m is not None and s.delete(m.entry_id)
        assert not s.delete(m.entry_id)  # a second delete drops nothing
    refs = stored_refs(s)
    live = {d: r.refcount for d, r in refs.items() if r.refcount}
    assert live == recount(s)
    t = s.local.index.totals()
    assert t.entries == 3
    assert t.physical_bytes == sum(r.size for r in refs.values())
    assert t.zero_bytes == sum(r.size for r in refs.values() if r.refcount == 0) > 0
    assert t.live_bytes == sum(r.size for r in refs.values() if r.refcount)
    sound_store(s)


def test_remove_entry_twice_does_not_drop_refs_twice(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    save(s, 1, 80, shared=32)
    save(s, 2, 80, shared=32)
    e = next(iter(s.entries()))
    digest = bytes.fromhex(e.id)
    got = s.local.catalog.manifest(digest)
    assert got is not None
    plan = delete_plan(got[1], got[0], digest)
    with s.local.index.write() as txn:
        s.local.index.remove_entry(txn, digest, plan)
    before = stored_refs(s)
    with s.local.index.write() as txn:
        assert s.local.index.remove_entry(txn, digest, plan) == []
    assert stored_refs(s) == before
    sound_store(s)


def test_compact_honours_the_grace(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    keep = save(s, 1, 90, shared=48)
    gone = save(s, 2, 90, shared=48)
    phys = s.stats().physical_bytes
    m = s.lookup(gone)
    assert m is not None and m.length == 90
    s.delete(m.entry_id)
    zero = s.local.index.totals().zero_bytes
    assert zero > 0
    r = s.compact(grace=600)
    assert (r.freed_blocks, r.freed_bytes, r.evicted) == (0, 0, [])
    assert s.stats().physical_bytes == phys
    r = s.compact(grace=0)
    assert r.freed_bytes == zero and r.physical_before == phys
    assert r.physical_after == phys - zero == s.stats().physical_bytes
    assert s.local.index.totals().zero_bytes == 0
    cache, n = s.restore(keep)
    assert cache is not None and matches(cache, keep, n) and n == 90
    cache, n = s.restore(gone)
    assert n == 48 and cache is not None and matches(cache, gone, 48)  # the shared prefix
    assert s.verify(read_data=True).clean


def test_orphans_and_stale_temp_files(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    save(s, 1, 40)
    orphan = kvstore.blocks.hash_bytes("blake3", b"orphan bytes")
    s.local.blocks.put(orphan, [b"orphan bytes"])
    dead = s.local.blocks.tmp_dir / "999999999-0-dead.tmp"
    dead.write_bytes(b"x")
    mine = s.local.blocks.tmp_dir / f"{os.getpid()}-0-live.tmp"  # a writer that is still running
    mine.write_bytes(b"y")
    old = time.time() - 3600
    for p in (dead, mine):
        os.utime(p, (old, old))
    r = s.compact(grace=600)  # the orphan is young: kept
    assert (r.orphans_removed, r.tmp_removed) == (0, 1)
    assert s.local.blocks.exists(orphan) and not dead.exists() and mine.exists()
    v = s.verify()
    assert v.sound and not v.clean and v.orphans == [orphan.hex()]
    r = s.compact(grace=0, dry_run=True)
    assert r.orphans_removed == 1 and s.local.blocks.exists(orphan)
    r = s.compact(grace=0)
    assert (r.orphans_removed, r.orphan_bytes) == (1, 12)
    assert not s.local.blocks.exists(orphan) and mine.exists()
    assert s.verify(read_data=True).clean


def test_eviction_order_mirrors_mlx_lm() -> None:
    rng = random.Random(3)
    names = ["assistant", "user", "system"]
    for _ in range(50):
        rows = []
        ours_rows: list[tuple[bytes, EntryRecord]] = []
        ref = LRUPromptCache.CacheOrder()
        for i in range(rng.randrange(1, 30)):
            p = rng.randrange(3)
            rows.append((i, p))
            ref.push("m", (i,), names[p])
            ours_rows.append(
                (
                    bytes([i]) * 32,
                    EntryRecord(
                        namespace="",
                        n_tokens=1,
                        logical_bytes=1,
                        created_at=0,
                        last_access=i,
                        priority=p,
                    ),
                )
            )
        ours = EvictionOrder(ours_rows)
        for _ in rows:
            want = ref.pop()[1][0]
            got = ours.pop()
            assert got == bytes([want]) * 32
        assert ours.pop() is None


def test_budget_evicts_lru_and_a_restore_counts_as_access(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    a = save(s, 1, 64)
    b = save(s, 2, 64)
    c = save(s, 3, 64)
    assert s.stats().physical_bytes == 12 * BLOCK
    time.sleep(0.01)
    assert s.restore(a)[0] is not None  # a is now the most recently used
    r = s.compact(max_bytes=8 * BLOCK, grace=0)
    assert len(r.evicted) == 1
    assert s.lookup(b) is None and s.lookup(a) is not None and s.lookup(c) is not None
    assert r.physical_after == s.stats().physical_bytes == 8 * BLOCK
    sound_store(s)


def test_budget_counts_only_what_eviction_frees(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    # ten entries share 160 tokens (10 blocks); each adds 2 blocks of its own
    toks = [save(s, i, 192, shared=160) for i in range(10)]
    assert s.stats().physical_bytes == (10 + 20) * BLOCK
    # evicting one frees 2 blocks, not its 12: to reach 26 blocks two must go
    r = s.compact(max_bytes=26 * BLOCK, grace=0)
    assert len(r.evicted) == 2 and r.freed_bytes == 4 * BLOCK
    assert r.physical_after == 26 * BLOCK
    gone = [(m := s.lookup(t)) is None or m.length < len(t) for t in toks]
    assert gone == [True, True] + [False] * 8
    # a budget below the shared part takes everything
    r = s.compact(max_bytes=9 * BLOCK, grace=0)
    assert len(r.evicted) == 8 and s.stats().physical_bytes == 0
    sound_store(s)


def test_budget_with_a_grace_defers_the_unlink(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    for i in range(4):
        save(s, i, 64)
    r = s.compact(max_bytes=8 * BLOCK, grace=600)
    assert len(r.evicted) == 2 and r.freed_bytes == 0
    t = s.local.index.totals()
    assert t.live_bytes == 8 * BLOCK and t.physical_bytes == 16 * BLOCK
    r = s.compact(max_bytes=8 * BLOCK, grace=600)  # pending garbage forces no new eviction
    assert r.evicted == []
    r = s.compact(max_bytes=8 * BLOCK, grace=0)
    assert r.evicted == [] and r.freed_bytes == 8 * BLOCK
    assert s.stats().physical_bytes == 8 * BLOCK
    sound_store(s)


def test_namespace_budget(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    other = kvstore.Namespace(model_id="other", config_fingerprint="c", tokenizer_hash="t")
    big = [save(s, i, 64) for i in range(4)]  # 16 blocks in NS
    small = tokens_for(99, 64)
    s.save(small, make_cache(small), namespace=other)  # 4 blocks
    r = s.compact(namespace_max_bytes=8 * BLOCK, grace=0)
    assert len(r.evicted) == 2
    assert [s.lookup(t) is None for t in big] == [True, True, False, False]
    assert s.lookup(small, namespace=other) is not None
    assert s.stats().physical_bytes == 12 * BLOCK
    sound_store(s)


def test_priorities_system_outlives_assistant(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    sys_t = save(s, 1, 64, priority="system")
    asst = save(s, 2, 64, priority="assistant")
    user = save(s, 3, 64, priority="user")
    time.sleep(0.01)
    s.restore(asst)  # the assistant entry is the most recently used, yet goes first
    s.compact(max_bytes=8 * BLOCK, grace=0)
    assert s.lookup(asst) is None and s.lookup(sys_t) is not None and s.lookup(user) is not None
    s.compact(max_bytes=4 * BLOCK, grace=0)
    assert s.lookup(user) is None and s.lookup(sys_t) is not None


def test_store_open_max_bytes_enforces_after_each_save(tmp_path: Path) -> None:
    budget = 20 * BLOCK
    s = open_store(tmp_path / "r", max_bytes=budget, gc_grace=0.0)
    for i in range(15):
        toks = save(s, i, 64 + 16 * (i % 3), shared=32)
        assert s.stats().physical_bytes <= budget
        cache, n = s.restore(toks)
        assert cache is not None and n == len(toks) and matches(cache, toks, n)
    assert s.stats().entries < 15
    sound_store(s)


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    for i in range(4):
        save(s, i, 64)
    before = (s.stats(), stored_refs(s), sorted(s.local.blocks))
    r = s.compact(max_bytes=8 * BLOCK, grace=0, dry_run=True)
    assert r.dry_run and len(r.evicted) == 2 and r.physical_after == 8 * BLOCK
    assert (s.stats(), stored_refs(s), sorted(s.local.blocks)) == before


def test_a_plan_does_exactly_what_it_reports_once(tmp_path: Path) -> None:
    """restic's plan: executing it evicts the planned victims and no other, even when a save
    takes the root over the budget again meanwhile (that is the next plan's), and a plan
    runs once."""
    s = open_store(tmp_path / "r")
    a, b, c = (save(s, i, 64) for i in (1, 2, 3))
    plan = plan_compact(s.local, max_bytes=8 * BLOCK, grace=0)
    planned = plan.report()
    assert planned.dry_run and len(planned.evicted) == 1
    d = save(s, 4, 64)  # over the budget again, after the plan was made
    done = plan.execute()
    assert not done.dry_run and done.evicted == planned.evicted
    assert s.lookup(a) is None and all(s.lookup(t) is not None for t in (b, c, d))
    assert s.stats().physical_bytes == 12 * BLOCK
    with pytest.raises(RuntimeError, match="once"):
        plan.execute()
    again = plan_compact(s.local, max_bytes=8 * BLOCK, grace=0).execute()
    assert len(again.evicted) == 1 and s.stats().physical_bytes == 8 * BLOCK
    sound_store(s)


def test_a_plan_skips_what_others_removed_meanwhile(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    for i in range(4):
        save(s, i, 64)
    plan = plan_compact(s.local, max_bytes=4 * BLOCK, grace=0)
    victims = plan.report().evicted
    assert len(victims) == 3
    assert s.delete(victims[1])  # another process deleted one of them
    done = plan.execute()
    assert done.evicted == [victims[0], victims[2]]
    assert (done.live_after, done.physical_after) == (4 * BLOCK, 8 * BLOCK)
    assert s.stats().entries == 1  # the deleted entry's blocks: garbage the plan never saw
    assert plan_compact(s.local, grace=0).execute().freed_bytes == 4 * BLOCK  # the next one
    assert s.stats().physical_bytes == 4 * BLOCK
    sound_store(s)


def test_the_budget_after_a_save_is_an_empty_plan_within_it(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    save(s, 1, 64)
    plan = plan_budget(s.local, 100 * BLOCK, grace=0)
    assert plan.empty() and plan.report().evicted == []
    over = plan_budget(s.local, 0, grace=0)
    assert len(over.report().evicted) == 1
    assert over.execute().physical_after == 0 and s.stats().entries == 0


def test_compact_rejects_bad_arguments(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    with pytest.raises(ValueError, match="grace"):
        s.compact(grace=-1)
    with pytest.raises(ValueError, match="max_bytes"):
        s.compact(max_bytes=-5)


def test_save_survives_a_gc_between_its_block_writes_and_its_commit(tmp_path: Path) -> None:
    """Reused zero-ref blocks and fresh orphans removed by a grace-0 GC are rewritten."""
    s = open_store(tmp_path / "r")
    gc_side = open_store(tmp_path / "r")
    old = save(s, 1, 100, shared=64)
    m = s.lookup(old)
    assert m is not None
    s.delete(m.entry_id)  # its blocks are at refcount zero now
    real = s.local.index.commit_save
    removed: list[int] = []

    def commit_after_gc(plan, **kw):  # type: ignore[no-untyped-def]
        time.sleep(0.005)  # grace 0 frees files last touched before this ms: not in it
        r = gc_side.compact(grace=0)
        removed.append(r.freed_blocks + r.orphans_removed)
        return real(plan, **kw)

    s.local.index.commit_save = commit_after_gc  # type: ignore[method-assign]
    again = tokens_for(1, 100, 64)  # reuses the zero-ref blocks
    s.save(again, make_cache(again))
    fresh = tokens_for(7, 90, 64)  # new blocks: orphans until the commit
    s.save(fresh, make_cache(fresh))
    assert removed[0] == 7 and removed[1] >= 2
    for t in (again, fresh):
        cache, n = s.restore(t, verify=True)
        assert cache is not None and n == len(t) and matches(cache, t, n)
    sound_store(s)


def test_save_rewrites_a_zero_ref_block_whose_file_a_killed_gc_unlinked(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    toks = save(s, 1, 48)
    m = s.lookup(toks)
    assert m is not None
    s.delete(m.entry_id)
    zero = [d for d, r in stored_refs(s).items() if r.refcount == 0]
    for d in zero:  # what a GC killed between its unlink and its commit leaves
        s.local.blocks.delete(d)
    v = s.verify()
    assert v.sound and sorted(v.dangling_refs) == sorted(d.hex() for d in zero)
    s.save(toks, make_cache(toks))
    cache, n = s.restore(toks, verify=True)
    assert cache is not None and matches(cache, toks, n)
    assert s.verify(read_data=True).clean
