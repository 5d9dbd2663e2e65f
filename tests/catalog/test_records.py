"""An entry's records are derived in one place (records_of) whatever path made them: a save,
a cut back to an intact prefix, the verify rebuild of a lost record, the reach-marker
migration. Each path's records are checked against records_of of the same manifest; and
the one comparison of token strings every lookup uses, against a brute-force model."""

from __future__ import annotations

import array
from pathlib import Path

import msgspec
from catalog.catalog_suite import same_records
from helpers.kv import NS, D, H, T, make_cache, open_store, tokens_for
from hypothesis import given
from hypothesis import strategies as st

import kvstore
from kvstore.catalog import keys as P
from kvstore.catalog.records import records_of


def _prefix_values(s: kvstore.Store, key: bytes) -> list[bytes]:
    with s.local.index.read() as txn:
        return s.local.index.prefix_values(key, txn)


def _stored_bytes(s: kvstore.Store, digests: list[bytes]) -> dict[bytes, int]:
    """Each distinct block's size, read from its file on disk (not from any record)."""
    return {d: s.local.blocks.path(d).stat().st_size for d in dict.fromkeys(digests)}


def test_a_saved_entry_is_recorded_as_records_of_its_manifest(tmp_path: Path) -> None:
    """Each field is checked against what the save was given and what lies on disk, never
    against records_of itself: a records_of that derived a field wrongly fails here."""
    with open_store(tmp_path / "r") as s:
        toks = tokens_for(1, 3 * T + 5)
        cache = make_cache(toks)
        info = s.save(toks, cache, priority="system", metadata={"purpose": "x"})
        d = bytes.fromhex(info.id)
        got = s.local.catalog.records(d)
        assert got is not None
        m = s.manifest(d)
        with s.local.index.read() as txn:
            raw = s.local.index.get_manifest(d, txn)
            entry = s.local.index.get_entry(d, txn)
        assert raw is not None and entry is not None
        keys = P.TokenKeys.of(toks, P.root_key(NS, m.codec, T, m.hash), T, m.hash)
        sizes = _stored_bytes(s, [bytes(b) for b in m.all_blocks()])
        kv_bytes = 2 * H * len(toks) * D * 2  # keys and values, float16
        assert (got.digest, got.manifest) == (d, bytes(raw))
        assert got.blocks == sizes and got.logical_bytes == kv_bytes == sum(sizes.values())
        assert (got.chain, got.exact_key) == (keys.chain, keys.exact_key())
        assert (got.tokens, got.n_tokens, got.block_tokens) == (keys.le, len(toks), T)
        assert got.trimmable and got.priority == 2  # a KV cache; "system"
        assert got.namespace == msgspec.json.encode(NS).decode()
        assert (entry.n_tokens, entry.logical_bytes, entry.priority) == (len(toks), kv_bytes, 2)
        assert entry.last_access == got.last_access and entry.hits == got.hits == 0
        # the prefix db holds the tokens of each full block under that depth's key
        for k, key in enumerate(keys.chain):
            value = P.prefix_value(toks[k * T : (k + 1) * T], True, d)
            assert value in _prefix_values(s, key), k
        # and a lookup of the same tokens finds it whole
        match = s.lookup(toks)
        assert match is not None and (match.digest, match.length, match.exact) == (
            d, len(toks), True)


def test_a_lost_record_is_rebuilt_from_the_manifest_alone(tmp_path: Path) -> None:
    """The manifest names no priority of its own but its mlx-lm cache type; the last use
    known from it alone is its creation. Checked in the index itself: the catalog's
    ``records`` answers the same fallback for a record that is missing, so a repair that
    rebuilt nothing would pass a check made through it."""
    with open_store(tmp_path / "r") as s:
        toks = tokens_for(2, 2 * T + 3)
        info = s.save(toks, make_cache(toks), priority="user", metadata={"cache_type": "user"})
        d = bytes.fromhex(info.id)
        with s.local.index.read() as txn:
            before = s.local.index.get_entry(d, txn)
        with s.local.index.write() as txn:
            s.local.index.delete_entry(txn, d)
        with s.local.index.read() as txn:
            assert s.local.index.get_entry(d, txn) is None
        rep = s.verify(repair=True)
        assert rep.repaired and s.verify().sound
        m = s.manifest(d)
        with s.local.index.read() as txn:
            entry = s.local.index.get_entry(d, txn)
        assert entry is not None and before is not None
        assert (entry.priority, entry.last_access, entry.hits) == (1, m.created_at, 0)
        assert (entry.n_tokens, entry.logical_bytes, entry.created_at) == (
            before.n_tokens, before.logical_bytes, before.created_at)
        assert entry.namespace == before.namespace
        got = s.local.catalog.records(d)
        assert got is not None
        same_records(got, records_of(m, last_access=m.created_at))


def test_a_cut_keeps_the_entrys_own_bookkeeping(tmp_path: Path) -> None:
    with open_store(tmp_path / "r") as s:
        toks = tokens_for(3, 4 * T)
        info = s.save(toks, make_cache(toks), priority="system")
        d = bytes.fromhex(info.id)
        before = s.local.catalog.records(d)
        m = s.manifest(d)
        s.local.blocks.path(m.token_blocks[2]).write_bytes(b"\0" * 10)  # the third block goes bad
        rep = s.verify(read_data=True, repair=True)
        assert len(rep.cut_entries) == 1
        _, new, n = rep.cut_entries[0]
        assert n == 2 * T
        got = s.local.catalog.records(bytes.fromhex(new))
        assert got is not None and before is not None
        want = records_of(s.manifest(new), priority=before.priority,
                          last_access=before.last_access, hits=before.hits)
        same_records(got, want)
        assert (got.priority, got.last_access) == (2, before.last_access)


def _model(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


tokens = st.lists(st.integers(0, 2**32 - 2), max_size=600)


@given(a=tokens, b=tokens, share=st.integers(0, 600))
def test_common_tokens_matches_the_model(a: list[int], b: list[int], share: int) -> None:
    b = a[:share] + b  # a shared head of any length, short or long
    want = _model(a, b)
    assert P.common_tokens(array.array("I", a).tobytes(), array.array("I", b).tobytes()) == want
    assert P.common_tokens(P.encode_tail(a), P.encode_tail(b)) == want  # the values' encoding
