"""The LMDB index alone: sorted neighbours, save/remove bookkeeping, totals."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.index import DeletePlan, EntryRecord, Index, SavePlan


@pytest.fixture
def index(tmp_path: Path):  # type: ignore[no-untyped-def]
    idx = Index(tmp_path / "index", durable=False)
    yield idx
    idx.close()


def _plan(digest: bytes, blocks: dict[bytes, int], key: bytes, values: list[bytes]) -> SavePlan:
    rec = EntryRecord(namespace="{}", n_tokens=1, logical_bytes=sum(blocks.values()),
                      created_at=0, last_access=0)
    return SavePlan(digest=digest, manifest=b"m" + digest, blocks=blocks,
                    prefix_items=[(key, v) for v in values], exact_key=b"x" + digest, entry=rec)


def test_neighbors_are_the_sorted_values_around_the_probe(index: Index) -> None:
    key = b"k" * 32
    values = [bytes([i]) * 4 for i in range(0, 200, 10)]
    index.commit_save(_plan(b"d" * 32, {}, key, values))
    with index.read() as txn:
        before, after = index.neighbors(key, bytes([95]) * 4, 3, txn)
        assert before == [bytes([i]) * 4 for i in (90, 80, 70)]
        assert after == [bytes([i]) * 4 for i in (100, 110, 120)]
        before, after = index.neighbors(key, bytes([250]), 2, txn)  # past the last value
        assert before == [bytes([190]) * 4, bytes([180]) * 4] and after == []
        assert index.neighbors(b"?" * 32, b"\0", 2, txn) == ([], [])


def test_save_and_remove_keep_refcounts_and_totals_exact(index: Index) -> None:
    a, b = b"a" * 32, b"b" * 32
    shared, own_a, own_b = b"s" * 32, b"1" * 32, b"2" * 32
    assert index.commit_save(_plan(a, {shared: 100, own_a: 10}, b"k" * 32, [b"va"]))
    assert index.commit_save(_plan(b, {shared: 100, own_b: 20}, b"k" * 32, [b"vb"]))
    assert not index.commit_save(_plan(a, {shared: 100, own_a: 10}, b"k" * 32, [b"va"]))
    t = index.totals()
    assert (t.entries, t.blocks, t.logical_bytes, t.physical_bytes) == (2, 3, 230, 130)
    with index.write() as txn:
        zeroed = index.remove_entry(
            txn, a, DeletePlan(blocks=[shared, own_a], prefix_items=[(b"k" * 32, b"va")],
                               exact_key=b"x" + a)
        )
    assert zeroed == [own_a]
    with index.read() as txn:
        assert index.get_ref(shared, txn).refcount == 1  # type: ignore[union-attr]
        ref = index.get_ref(own_a, txn)
        assert ref is not None and ref.refcount == 0 and ref.zero_since > 0
        assert index.get_manifest(a, txn) is None and index.find_exact(b"x" + a, txn) is None
        assert index.neighbors(b"k" * 32, b"", 5, txn)[1] == [b"vb"]
    t = index.totals()
    assert (t.entries, t.logical_bytes, t.physical_bytes, t.zero_bytes) == (1, 120, 130, 10)


def test_access_stamps_are_batched_into_one_transaction(index: Index) -> None:
    a = b"a" * 32
    index.commit_save(_plan(a, {}, b"k" * 32, [b"v"]))
    index.record_access({a: 3, b"?" * 32: 1}, lookups=5, found=3)
    with index.read() as txn:
        rec = index.get_entry(a, txn)
    assert rec is not None and rec.hits == 3 and rec.last_access > 0
    t = index.totals()
    assert (t.lookups, t.hits) == (5, 3)


def test_a_traced_read_records_every_get_and_cursor_move_for_replay(index: Index) -> None:
    key = b"k" * 32
    index.commit_save(_plan(b"d" * 32, {}, key, [bytes([i]) * 4 for i in range(10)]))
    with index.traced_read() as txn:
        assert index.get_manifest(b"d" * 32, txn) == b"m" + b"d" * 32  # type: ignore[arg-type]
        assert not index.has_prefix(b"?" * 32, txn)  # type: ignore[arg-type]
        before, after = index.neighbors(key, bytes([5]) * 4, 2, txn)  # type: ignore[arg-type]
        reads = txn.reads
    assert len(before) == len(after) == 2
    # two gets; set_key, set_range_dup, a next_dup, set_range_dup again, two prev_dups
    assert len(reads) == 2 + 6
    assert reads[0] == (index.db("manifests"), b"d" * 32)
    assert all(k == key for _, k in reads[2:])
    assert index.replay_reads(reads) == 7  # every read but the missing prefix key
