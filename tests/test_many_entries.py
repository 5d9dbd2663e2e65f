"""Listing a root of many entries with bounded memory (issue 29, item 7)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from factories import prefix_cache

import kvstore
from kvstore.local import gc, sweep
from kvstore.store import maintenance

NS = kvstore.Namespace(model_id="tiny-many", config_fingerprint="cfg", tokenizer_hash="tok")
OTHER = kvstore.Namespace(model_id="tiny-other", config_fingerprint="cfg", tokenizer_hash="tok")


def test_entries_are_read_a_batch_at_a_time_in_id_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With batches of 3, entries() lists each of 10 entries once, in id order, each
    namespace decoded once; an entry removed between batches is not listed."""
    monkeypatch.setattr(maintenance, "_BATCH", 3)
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=16) as s:
        ids = []
        for i in range(10):
            toks = [i + 1] * 20
            ids.append(s.save(toks, [prefix_cache(toks, mx.float16, heads=1, dim=4)],
                              namespace=OTHER if i % 4 == 0 else NS).id)
        listed = list(s.entries())
        assert [e.id for e in listed] == sorted(ids)
        assert len({id(e.namespace) for e in listed}) == 2  # one value per namespace
        assert [e.id for e in s.entries(namespace=OTHER)] == sorted(ids[::4])
        it = s.entries()
        first = [next(it) for _ in range(3)]
        last = sorted(ids)[-1]
        assert s.delete(last)
        rest = list(it)
        assert [e.id for e in first + rest] == sorted(ids)[:-1]


def test_a_compact_plan_reads_the_refs_of_its_victims_blocks_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan holds the refs records of the blocks its victims reference, not every
    block's; it evicts what a plan over every record evicts (the two oldest), and the
    orphan files it finds, listed 2 at a time, are all of them."""
    seen: list[gc._Snapshot] = []
    plan_in = gc._plan_in

    def spy(snap: gc._Snapshot, *a: object, **kw: object) -> object:
        seen.append(snap)
        return plan_in(snap, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(gc, "_plan_in", spy)
    monkeypatch.setattr(sweep, "BATCH", 2)
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=16) as s:
        ids = []
        for i in range(12):
            toks = [100 * i + j + 1 for j in range(32)]  # two blocks of its own
            ids.append(s.save(toks, [prefix_cache(toks, mx.float16, heads=1, dim=4)]).id)
        orphans = []
        for i in range(5):
            data = b"orphan %d" % i
            orphans.append(kvstore.blocks.hash_bytes("blake3", data))
            s.local.blocks.put(orphans[-1], [data])
        per_entry = s.stats().physical_bytes // 12
        r = s.compact(max_bytes=per_entry * 10, grace=0, dry_run=True)
        assert r.evicted == ids[:2]  # saved first: least recently used
        assert r.orphans_removed == 5
        assert len(seen) == 1 and len(seen[0].counts) == 4  # 2 victims x 2 blocks
        r = s.compact(max_bytes=per_entry * 10, grace=0)
        assert r.evicted == ids[:2] and r.orphans_removed == 5
        assert [e.id for e in s.entries()] == sorted(ids[2:])
        assert not any(s.local.blocks.exists(d) for d in orphans)
