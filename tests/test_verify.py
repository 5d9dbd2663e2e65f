"""verify: corruption, truncation, missing blocks, refcount and totals drift, repair."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.kv import make_cache, matches, open_store, sound_store, tokens_for

import kvstore
from kvstore.index import RefInfo


@pytest.fixture
def two(tmp_path: Path) -> tuple[kvstore.Store, list[int], list[int]]:
    """A store with two entries sharing two blocks; ``a`` has blocks of its own."""
    s = open_store(tmp_path / "r")
    a = tokens_for(1, 100, shared=32)
    b = tokens_for(2, 80, shared=32)
    s.save(a, make_cache(a))
    s.save(b, make_cache(b))
    return s, a, b


def own_block(s: kvstore.Store, toks: list[int]) -> bytes:
    """A token block of the entry of ``toks`` that no other entry uses (its 4th)."""
    m = s.lookup(toks)
    assert m is not None
    return bytes(s.manifest(m.entry_id).token_blocks[3])


def test_a_clean_store_is_sound(two: tuple[kvstore.Store, list[int], list[int]]) -> None:
    s, _, _ = two
    r = s.verify(read_data=True)
    assert r.sound and r.clean and r.entries == 2 and r.bytes_hashed == s.stats().physical_bytes


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corruption_is_caught_quarantined_and_dependents_stop_matching(
    two: tuple[kvstore.Store, list[int], list[int]], damage: str
) -> None:
    s, a, b = two
    d = own_block(s, a)
    s_id = s.lookup(a).entry_id  # type: ignore[union-attr]
    path = s.local.blocks.path(d)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[5] ^= 0x01
        path.write_bytes(bytes(data))
        assert s.verify().sound  # sizes are right: only reading the data tells
    else:
        path.write_bytes(bytes(data[:-7]))
    r = s.verify(read_data=True)
    assert not r.sound and r.corrupt_blocks == [d.hex()]
    r = s.verify(read_data=True, repair=True)
    assert r.repaired and r.quarantined == [d.hex()] and r.dropped_entries == []
    assert [(old, n) for old, _, n in r.cut_entries] == [(s_id, 48)]  # blocks 0-2 intact
    assert (s.local.blocks.quarantine_dir / d.hex()).exists() and not path.exists()
    m = s.lookup(a)
    assert m is not None and m.length == 48  # the entry was cut back, not dropped
    cache, n = s.restore(b, verify=True)
    assert cache is not None and n == len(b) and matches(cache, b, n)
    sound_store(s)
    assert s.verify(read_data=True).clean
    s.save(a, make_cache(a))  # saving it again rewrites the block, good bytes
    cache, n = s.restore(a, verify=True)
    assert cache is not None and matches(cache, a, n) and n == len(a)


def test_a_missing_block_drops_its_entries(two: tuple[kvstore.Store, list[int], list[int]]) -> None:
    s, a, b = two
    d = own_block(s, a)
    s.local.blocks.delete(d)
    r = s.verify()
    assert not r.sound and r.missing_blocks == [d.hex()]
    assert s.restore(a) == (None, 0)
    r = s.verify(repair=True)
    assert len(r.cut_entries) == 1 and r.dropped_entries == [] and r.quarantined == []
    assert s.stats().entries == 2 and s.lookup(a).length == 48  # type: ignore[union-attr]
    sound_store(s)
    assert s.verify().clean


def test_refcount_and_totals_drift_are_found_and_fixed(
    two: tuple[kvstore.Store, list[int], list[int]],
) -> None:
    s, a, _ = two
    d = own_block(s, a)
    with s.local.index.write() as txn:
        ref = s.local.index.get_ref(d, txn)
        assert ref is not None
        s.local.index.put_ref(txn, d, RefInfo(ref.refcount + 2, ref.size, 0))
        t = s.local.index.totals(txn)
        t.physical_bytes += 999
        t.entries += 1
        s.local.index.put_totals(txn, t)
    r = s.verify()
    assert not r.sound
    assert r.refcount_drift == [(d.hex(), 3, 1)]
    assert {name for name, _, _ in r.totals_drift} == {"physical_bytes", "entries"}
    s.verify(repair=True)
    assert s.verify(read_data=True).clean
    assert s.stats().entries == 2


def test_dangling_keys_and_missing_refs_records(
    two: tuple[kvstore.Store, list[int], list[int]],
) -> None:
    s, a, b = two
    m = s.lookup(b)
    assert m is not None
    digest = bytes.fromhex(m.entry_id)
    d = own_block(s, a)
    with s.local.index.write() as txn:  # a manifest gone without its keys; a refs record gone
        txn.delete(digest, db=s.local.index.db("manifests"))
        txn.delete(d, db=s.local.index.db("refs"))
    r = s.verify()
    assert not r.sound and r.dangling_keys > 0
    assert any(blk == d.hex() and stored == -1 for blk, stored, _ in r.refcount_drift)
    s.verify(repair=True)
    assert s.verify(read_data=True).clean
    cache, n = s.restore(a, verify=True)
    assert cache is not None and n == len(a) and matches(cache, a, n)
    m = s.lookup(b)
    assert m is None or m.length <= 32


def test_leftovers_do_not_make_a_store_unsound(
    two: tuple[kvstore.Store, list[int], list[int]],
) -> None:
    s, a, _ = two
    orphan = kvstore.blocks.hash_bytes("blake3", b"left behind")
    s.local.blocks.put(orphan, [b"left behind"])
    r = s.verify(read_data=True)
    assert r.sound and not r.clean and r.orphans == [orphan.hex()]
    r = s.verify(repair=True)
    assert r.orphans_removed == 1 and not s.local.blocks.exists(orphan)
    assert s.verify(read_data=True).clean
