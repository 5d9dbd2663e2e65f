"""The composed tier (``Tiers``: a root above a second root) passes the shared catalog
suite, and what only it does: an entry of the tier below is found and read through it
(``where`` names that tier), a commit is written behind to the tier below, a removed entry
is gone from both."""

from __future__ import annotations

from pathlib import Path

import pytest
from catalog.catalog_suite import CatalogTests, Entry, T, commit, lookup, same_records
from helpers.composed import BELOW, ComposedCatalogCase, Opened

from kvstore.catalog.find import Match
from kvstore.local import Root
from kvstore.store.tiers import Tiers


@pytest.fixture
def below(opened: Opened, tmp_path: Path) -> Root:
    return opened.root(tmp_path / "below", name=BELOW, block_tokens=T)


@pytest.fixture
def tiers(opened: Opened, tmp_path: Path, below: Root) -> Tiers:
    return opened.tiers(opened.root(tmp_path / "top", block_tokens=T), [below])


class TestComposedCatalog(ComposedCatalogCase, CatalogTests):
    pass


def test_the_composed_tier_is_named_as_its_root(tiers: Tiers) -> None:
    assert (tiers.name, tiers.catalog.name, tiers.catalog.read_only) == ("local", "local", False)


def test_an_entry_only_below_is_found_and_read_through_the_composed_catalog(
        tiers: Tiers, below: Root) -> None:
    toks = list(range(10, 20))
    e = Entry(toks, priority=2)
    assert commit(below, e) is True
    cat = tiers.catalog
    assert lookup(cat, toks) == Match(e.digest, 10, True, True, 10, where=BELOW)
    assert lookup(cat, toks[:6]) == Match(e.digest, 6, False, True, 10, where=BELOW)
    assert cat.exact(e.records.exact_key) == e.digest
    assert cat.manifest(e.digest) == (e.records.manifest, e.manifest)
    got = cat.records(e.digest)
    assert got is not None
    same_records(got, e.records)
    assert list(cat) == [e.digest]
    assert cat.where(e.digest) == below.catalog.where(e.digest)
    assert list(tiers.root.catalog) == []  # a lookup alone writes nothing back


def test_a_longer_entry_below_wins_over_the_roots(tiers: Tiers, below: Root) -> None:
    short, long = Entry(list(range(30, 38))), Entry(list(range(30, 42)))
    commit(tiers.root, short)
    commit(below, long)
    got = lookup(tiers.catalog, list(range(30, 42)) + [1])
    assert got == Match(long.digest, 12, False, True, 12, where=BELOW)
    got = lookup(tiers.catalog, list(range(30, 38)))
    assert got == Match(short.digest, 8, True, True, 8, where="local")  # exact: not asked
    assert sorted(tiers.catalog) == sorted([short.digest, long.digest])


def test_a_commit_reaches_the_tier_below_after_flush(tiers: Tiers, below: Root) -> None:
    e = Entry(list(range(50, 61)), priority=2)
    assert commit(tiers, e) is True
    tiers.flush()
    got = below.catalog.records(e.digest)
    assert got is not None
    same_records(got, e.records)
    assert below.catalog.exact(e.records.exact_key) == e.digest
    assert {d: below.blocks.get(d) for d in e.records.blocks} == e.bytes
    assert lookup(below.catalog, list(range(50, 61))) == Match(e.digest, 11, True, True, 11,
                                                               where=BELOW)


def test_a_removed_entry_is_gone_from_both_tiers(tiers: Tiers, below: Root) -> None:
    e, only_below = Entry(list(range(70, 80))), Entry(list(range(90, 95)))
    commit(tiers, e)
    tiers.flush()
    commit(below, only_below)
    assert below.catalog.records(e.digest) is not None  # written behind
    assert tiers.catalog.remove(e.digest) is True
    for root in (tiers.root, below):
        assert root.catalog.records(e.digest) is None
        assert root.catalog.exact(e.records.exact_key) is None
        assert lookup(root.catalog, list(range(70, 80))) is None
    assert tiers.catalog.remove_many([only_below.digest, e.digest]) == [only_below.digest]
    assert list(below.catalog) == [] and list(tiers.catalog) == []


def test_a_removal_waits_for_the_entrys_write_behind(tiers: Tiers, below: Root) -> None:
    """Removed as soon as committed, while its copy below may be under way: the copy does
    not bring it back below."""
    entries = [Entry(list(range(100 + 20 * i, 112 + 20 * i))) for i in range(8)]
    for e in entries:
        commit(tiers, e)
    assert tiers.catalog.remove_many([e.digest for e in entries]) == [e.digest for e in entries]
    tiers.flush()
    assert list(below.catalog) == [] and list(tiers.catalog) == []


def test_a_commit_whose_blocks_are_only_below_writes_them_back(tiers: Tiers,
                                                              below: Root) -> None:
    """The caller's ensure finds the blocks in the composed store (the tier below holds
    them): the root gets them before its entry is visible."""
    e = Entry(list(range(130, 139)))
    for d, data in e.bytes.items():
        below.blocks.put(d, [data])
    assert commit(tiers, e) is True
    assert sorted(tiers.root.blocks.iter()) == sorted(e.bytes)
    assert all(tiers.root.blocks.get(d) == data for d, data in e.bytes.items())


def test_take_copies_into_the_root_and_writes_behind(opened: Opened, tmp_path: Path,
                                                     tiers: Tiers, below: Root) -> None:
    """An entry copied into the composed tier from another tier's blocks (how a store's
    tiers copy entries between them) lands in the root, then, written behind, below."""
    source = opened.root(tmp_path / "source", name="source", block_tokens=T)
    e = Entry(list(range(140, 151)), priority=1)
    commit(source, e)
    got = tiers.take(e.records, source.blocks)
    assert (got.created, got.blocks, got.present) == (True, len(e.bytes), 0)
    assert tiers.root.catalog.exact(e.records.exact_key) == e.digest
    tiers.flush()
    for root in (tiers.root, below):
        rec = root.catalog.records(e.digest)
        assert rec is not None
        same_records(rec, e.records)
        assert {d: root.blocks.get(d) for d in e.records.blocks} == e.bytes
    assert tiers.take(e.records, source.blocks).created is False
