"""Compaction thins checkpoints first (issue 26): intermediate ones by level, then the
deepest of each conversation, then the other entries in mlx-lm's order; never leaving
anything pointing at what it evicted."""

from __future__ import annotations

import array
from pathlib import Path

from helpers.kv import hybrid_cache

import kvstore
from kvstore.catalog.thinning import checkpoint_order, level
from kvstore.index import EntryRecord

NS = kvstore.Namespace(model_id="thin")
T = 16


def _le(tokens: list[int]) -> bytes:
    return array.array("I", tokens).tobytes()


def test_level_is_the_trailing_zero_bits() -> None:
    assert [level(n) for n in (1024, 2048, 3072, 4096, 5120, 6144)] == [10, 11, 10, 12, 10, 11]
    assert [level(n) for n in (96, 192, 288)] == [5, 6, 5]  # any interval: every other first
    assert level(0) == 0


def test_order_intermediate_by_level_then_the_deepest_then_nothing_else() -> None:
    a = list(range(10, 6000))
    b = list(range(20, 6000))
    rows: list[tuple[bytes, EntryRecord]] = []
    tokens: dict[bytes, bytes] = {}

    def add(name: str, toks: list[int], n: int, access: int, priority: int = -1,
            ns: str = "ns") -> None:
        d = name.encode().ljust(32, b"_")
        rows.append((d, EntryRecord(namespace=ns, n_tokens=n, logical_bytes=1, created_at=0,
                                    last_access=access, priority=priority)))
        tokens[d] = _le(toks[:n])

    for k, access in zip(range(1, 6), (50, 40, 30, 20, 10), strict=True):
        add(f"a{k}", a, 1024 * k, access)
    add("b1", b, 1024, 5)
    add("b2", b, 2048, 60)
    add("c1", a, 1024, 1, ns="other")  # same tokens, another namespace: its own conversation
    add("user", a, 5500, 0, priority=1)  # not a checkpoint: never in this order
    add("gone", b, 3072, 0)  # its manifest went meanwhile
    del tokens[b"gone".ljust(32, b"_")]
    order = [d.rstrip(b"_").decode() for d in checkpoint_order(rows, tokens.get)]
    assert order == [
        "b1", "a3", "a1",  # intermediate, level 10 (odd multiples), least recently used first
        "a2",  # level 11
        "a4",  # level 12
        "c1", "a5", "b2",  # the deepest of each conversation, least recently used first
    ]


def test_compact_thins_checkpoints_before_anything_else(tmp_path: Path) -> None:
    doc = list(range(100, 100 + 8 * 4 * T))
    other = list(range(5000, 5000 + 2 * 4 * T))
    root = tmp_path / "root"
    ids: dict[str, str] = {}
    with kvstore.Store.open(root, namespace=NS, block_tokens=T) as s:
        for k in range(1, 9):  # a checkpoint every 4 blocks, as prefill saves them
            ids[f"d{k}"] = s.save(doc[: 4 * T * k], hybrid_cache(doc[: 4 * T * k]),
                                  priority="checkpoint", reuse_prefix=True).id
        for k in (1, 2):
            ids[f"o{k}"] = s.save(other[: 4 * T * k], hybrid_cache(other[: 4 * T * k]),
                                  priority="checkpoint").id
        ids["end"] = s.save(doc + [1, 2], hybrid_cache(doc + [1, 2]), priority="user").id
        before = s.stats().physical_bytes
        state = 64 * 64 * 4
        # room for all but three checkpoints' states: exactly three go
        dry = s.compact(max_bytes=before - 3 * state, grace=0, dry_run=True)
        done = s.compact(max_bytes=before - 3 * state, grace=0)
        names = {v: k for k, v in ids.items()}
        assert [names[e] for e in done.evicted] == [names[e] for e in dry.evicted]
        # level 6 first (odd multiples of 4T = 64 tokens), least recently used first
        assert [names[e] for e in done.evicted] == ["d1", "d3", "d5"]
        left = {e.id for e in s.entries()}
        assert left == set(ids.values()) - set(done.evicted)
        v = s.verify(read_data=True)  # refcounts, keys and totals exact: nothing dangles
        assert v.sound and v.clean and v.dangling_keys == 0
        # an edit inside the document restores the deepest checkpoint left before it
        cache, n = s.restore(doc[: 3 * 4 * T + 5] + [9, 9, 9])
        assert n == 2 * 4 * T and cache is not None
        # a budget that needs every intermediate checkpoint: the deepest and the end stay
        s.compact(max_bytes=s.stats().physical_bytes - 5 * state, grace=0)
        kept = {names[e.id] for e in s.entries()}
        assert kept == {"d8", "o2", "end"}
        for e in s.entries():
            m = s.manifest(e.id)
            cache, n = s.restore(list(array.array("I", m.tokens)) + [7])
            assert n == m.n_tokens and cache is not None


def test_a_record_rebuilt_from_the_manifest_is_still_a_checkpoint(tmp_path: Path) -> None:
    """verify --repair (and a pull from the remote) make an entry's record from its manifest
    alone: a checkpoint keeps its priority, so it is still thinned first."""
    toks = list(range(300, 300 + 4 * T))
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=T) as s:
        ckpt = s.save(toks, hybrid_cache(toks), priority="checkpoint",
                      metadata={"cache_type": "checkpoint"}).id
        user = s.save(toks + [1], hybrid_cache(toks + [1]), priority="user",
                      metadata={"cache_type": "user"}).id
        with s.local.index.write() as txn:
            for eid in (ckpt, user):
                s.local.index.delete_entry(txn, bytes.fromhex(eid))
        assert sorted(s.verify(repair=True).missing_entry_records) == sorted([ckpt, user])
        got = {e.id: e.priority for e in s.entries()}
        # every entry by its manifest's cache type (catalog.records.priority_of)
        assert got == {ckpt: "checkpoint", user: "user"}
        assert s.verify().sound


def test_the_save_time_budget_thins_checkpoints_first(tmp_path: Path) -> None:
    """``Store.open(max_bytes=...)`` (``kvstore serve --max-bytes``) evicts by the same plan
    (``plan_budget``): an older assistant entry stays, the finest checkpoint goes."""
    doc = list(range(100, 100 + 4 * 4 * T))
    root = tmp_path / "root"
    with kvstore.Store.open(root, namespace=NS, block_tokens=T) as s:
        old = s.save(list(range(7000, 7000 + 2 * T)), hybrid_cache(list(range(7000, 7000 + 2 * T))),
                     priority="assistant").id  # the least recently used entry of all
        ids = {f"d{k}": s.save(doc[: 4 * T * k], hybrid_cache(doc[: 4 * T * k]),
                               priority="checkpoint", reuse_prefix=True).id
               for k in range(1, 5)}
        live = s.stats().physical_bytes
    end = doc + [1, 2]
    # the end adds its state and a 2-token block: the budget has room for the block only
    with kvstore.Store.open(root, namespace=NS, block_tokens=T, max_bytes=live + 256,
                            gc_grace=0) as s:
        s.save(end, hybrid_cache(end), priority="user", reuse_prefix=True)
        left = {e.id for e in s.entries()}
        assert set(ids.values()) - left == {ids["d1"]}  # level 6, least recently used
        assert old in left
        assert s.stats().physical_bytes <= live + 256
        v = s.verify(read_data=True)
        assert v.sound and v.clean and v.dangling_keys == 0
