"""Lookup against a brute-force model of its semantics, and its bounded cost."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from factories import arrays_cache, prefix_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstore
from kvstore import schema
from kvstore.catalog import base as catalog_base
from kvstore.local import catalog as lookup_mod
from kvstore.store import store as store_mod

NS = kvstore.Namespace(model_id="lookup")
seqs = st.lists(st.integers(0, 2), min_size=1, max_size=14)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _expected(entries: list[tuple[list[int], bool]], q: list[int]) -> tuple[int, bool]:
    best, exact = 0, False
    for toks, trimmable in entries:
        if trimmable:
            length = min(_lcp(toks, q), len(q))
        else:
            length = len(toks) if _lcp(toks, q) == len(toks) else 0
        is_exact = toks == q
        if (length, is_exact) > (best, exact):
            best, exact = length, is_exact and length == len(q)
    return best, exact


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stored=st.lists(st.tuples(seqs, st.booleans()), min_size=1, max_size=12),
    queries=st.lists(seqs, min_size=1, max_size=6),
)
def test_lookup_matches_the_model(
    stored: list[tuple[list[int], bool]], queries: list[list[int]]
) -> None:
    with tempfile.TemporaryDirectory() as d:
        with kvstore.Store.open(Path(d), namespace=NS, block_tokens=4, durable=False) as s:
            kept: dict[tuple[int, ...], bool] = {}
            for toks, trimmable in stored:
                if tuple(toks) in kept:  # same tokens again: the first save stays
                    continue
                cache = [prefix_cache(toks)] if trimmable else [arrays_cache(len(toks))]
                s.save(toks, cache)
                kept[tuple(toks)] = trimmable
            entries = [(list(t), tr) for t, tr in kept.items()]
            for q in queries + [e[0] for e in entries]:
                m = s.lookup(q)
                want, exact = _expected(entries, q)
                got = (m.length, m.exact) if m else (0, False)
                assert got == (want, exact), (q, entries, m)
                s.local.catalog.bisect = False  # walking every depth gives the same answer
                assert s.lookup(q) == m
                s.local.catalog.bisect = True
                if m is not None:
                    man = s.manifest(m.entry_id)
                    toks = list(store_mod.P.tokens_from_le(man.tokens))
                    assert toks[: m.length] == q[: m.length]


def test_lookup_work_is_bounded_by_the_query_not_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 entries share a system prompt; a lookup decodes at most a few manifests."""
    system = list(range(40))
    with kvstore.Store.open(tmp_path / "r", namespace=NS, block_tokens=16, durable=False) as s:
        for i in range(300):
            toks = system + [1000 + i, 2000 + i % 17, 3000 + i]
            s.save(toks, [prefix_cache(toks)])
        decodes = 0
        real = schema.decode_manifest

        def counting(data: bytes) -> schema.Manifest:
            nonlocal decodes
            decodes += 1
            return real(data)

        monkeypatch.setattr(catalog_base, "decode_manifest", counting)
        for i in (0, 150, 299):
            q = system + [1000 + i, 2000 + i % 17, 3000 + i, 5, 6]
            m = s.lookup(q)
            assert m is not None and m.length == 43
        q = system + [999_999]
        m = s.lookup(q)
        assert m is not None and m.length == 40
        assert decodes <= 3 * 2 * lookup_mod.SCAN


def test_an_exact_prefix_among_many_entries_tied_past_the_value_cap_is_found(
    tmp_path: Path,
) -> None:
    """60 conversations share a system prompt that ends mid-block and a template longer than
    a prefix value holds (keys.TAIL tokens): their values under the block tie, so the sorted
    neighbours of the query are not enough. The entry that is exactly a prefix of the query
    (the previous turn of its conversation) must still be found, and nothing shorter."""
    T = 256
    system, template = list(range(300)), list(range(5000, 5000 + 60))
    assert len(system) + len(template) - T > store_mod.P.TAIL  # the tie reaches past the cap
    convs = [system + template + [10_000 + 50 * i + j for j in range(50)] for i in range(60)]
    with kvstore.Store.open(tmp_path / "r", namespace=NS, block_tokens=T, durable=False) as s:
        ids = [s.save(toks, [prefix_cache(toks)]).id for toks in convs]
        for i in range(0, 60, 7):
            q = convs[i] + [7, 8, 9]  # the next turn of conversation i
            m = s.lookup(q)
            assert m is not None and (m.length, m.entry_id) == (len(convs[i]), ids[i]), (i, m)
        q = system + template + [77]  # no conversation's own tokens: the shared part only
        m = s.lookup(q)
        assert m is not None and m.length == len(system) + len(template)


def _prefix_keys(s: kvstore.Store, suffix: bytes) -> list[bytes]:
    with s.local.index.read() as txn:
        cur = txn.cursor(db=s.local.index.db("prefix"))
        return [bytes(k) for k in cur.iternext_nodup(keys=True, values=False)
                if len(k) == 33 and k.endswith(suffix)]


def test_lookup_probes_logarithmically_many_depths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4096-token query matching 40 tokens: bisection, not a walk of 257 depths."""
    with kvstore.Store.open(tmp_path / "r", namespace=NS, block_tokens=16, durable=False) as s:
        s.save(list(range(40)), [prefix_cache(list(range(40)))])
        s.save(list(range(50)), [arrays_cache(50)])  # a non-trimmable entry, deeper
        probes = 0
        real = s.local.index.has_prefix

        def counting(key: bytes, txn: object) -> bool:
            nonlocal probes
            probes += 1
            return real(key, txn)

        monkeypatch.setattr(s.local.index, "has_prefix", counting)
        q = list(range(50)) + [9] * (4096 - 50)
        m = s.lookup(q)
        assert m is not None and (m.length, m.trimmable) == (50, False)
        assert probes <= 2 * (9 + 1) + 2 * 2  # log2(257) bisection steps, then depths 3 and 2
        probes = 0
        m = s.lookup(list(range(45)) + [9] * (4096 - 45))  # the non-trimmable one does not fit
        assert m is not None and (m.length, m.trimmable) == (40, True)
        assert probes <= 2 * (9 + 1) + 2 * 3


def test_reach_markers_follow_non_trimmable_entries(tmp_path: Path) -> None:
    """One marker per depth of a non-trimmable entry (none for trimmable ones), gone on delete."""
    with kvstore.Store.open(tmp_path / "r", namespace=NS, block_tokens=16, durable=False) as s:
        s.save(list(range(40)), [prefix_cache(list(range(40)))])
        assert _prefix_keys(s, b"r") == []
        info = s.save(list(range(50)), [arrays_cache(50)])
        assert len(_prefix_keys(s, b"r")) == 50 // 16 + 1
        assert s.delete(info.id)
        assert _prefix_keys(s, b"r") == [] and _prefix_keys(s, b"s") == []


def test_a_root_without_reach_markers_gets_them_on_open(tmp_path: Path) -> None:
    """Roots written before reach markers: walked until reopened, then migrated once."""
    root = tmp_path / "r"
    deep = list(range(70))
    with kvstore.Store.open(root, namespace=NS, block_tokens=16, durable=False) as s:
        s.save(list(range(20)), [prefix_cache(list(range(20)))])
        info = s.save(deep, [arrays_cache(70)])
        s.save(list(range(100, 140)), [arrays_cache(40)])
        with s.local.index.write() as txn:  # back to the old layout
            for k in _prefix_keys(s, b"r"):
                txn.delete(k, db=s.local.index.db("prefix"))
            txn.delete(lookup_mod.REACH_META, db=s.local.index.db("meta"))
        assert _prefix_keys(s, b"r") == []
        s.local.catalog.bisect = True  # what bisecting an old root would get wrong
        wrong = s.lookup(deep + [1, 2])
        assert wrong is not None and wrong.length == 20
    with kvstore.Store.open(root, namespace=NS, durable=False) as s:
        assert s.local.catalog.bisect
        assert len(_prefix_keys(s, b"r")) == (70 // 16 + 1) + (40 // 16 + 1) - 1  # c_0 shared
        m = s.lookup(deep + [1, 2])
        assert m is not None and (m.entry_id, m.length) == (info.id, 70)
        assert s.local.catalog.add_reach_markers() == 0  # once only
