"""The composed tier over the gateway (``Tiers``: a root above a bucket) passes the shared
catalog and block-store suites, as each of its tiers does, and what only it does there:
an entry or a block of the bucket is read through it (the block written back into the
root), a commit reaches the bucket after flush, a removal or a deletion every tier."""

from __future__ import annotations

from pathlib import Path

import pytest
from blocks.blockstore_suite import BlockStoreTests, block
from catalog.catalog_suite import CatalogTests, Entry, T, commit, lookup, same_records
from helpers.composed import ComposedBlocksCase, ComposedCatalogCase, Opened

from kvstore.blocks import hash_bytes
from kvstore.blocks.base import BlockStore
from kvstore.catalog.find import Match
from kvstore.errors import CorruptBlockError
from kvstore.remote import Remote
from kvstore.store.tiers import Tiers


def composed(opened: Opened, path: Path, url: str, hash: str = "blake3") -> Tiers:
    """A root at ``path`` above the bucket at ``url`` (closed with ``opened``)."""
    root = opened.root(path, hash=hash, block_tokens=T)
    remote = Remote(url)
    remote.attach(root.settings, create=True)
    return opened.tiers(root, [remote])


@pytest.fixture
def tiers(opened: Opened, tmp_path: Path, url: str) -> Tiers:
    return composed(opened, tmp_path / "top", url)


def _remote(tiers: Tiers) -> Remote:
    r = tiers.lower[0]
    assert isinstance(r, Remote)
    return r


class TestComposedRemoteCatalog(ComposedCatalogCase, CatalogTests):
    pass


class TestComposedRemoteBlocks(ComposedBlocksCase, BlockStoreTests):
    @pytest.fixture(params=["blake3", "sha256"])
    def store(self, opened: Opened, tmp_path: Path, url: str, request: pytest.FixtureRequest
              ) -> BlockStore:
        self.opened = opened
        return composed(opened, tmp_path / "top", url, request.param).blocks


def test_an_entry_only_in_the_bucket_is_found_and_read_through_the_composed_catalog(
        tiers: Tiers) -> None:
    remote = _remote(tiers)
    toks = list(range(10, 20))
    e = Entry(toks, priority=2)
    assert commit(remote, e) is True
    cat = tiers.catalog
    assert lookup(cat, toks + [1]) == Match(e.digest, 10, False, True, 10, where="remote")
    assert cat.exact(e.records.exact_key) == e.digest
    assert cat.manifest(e.digest) == (e.records.manifest, e.manifest)
    got = cat.records(e.digest)
    assert got is not None
    same_records(got, e.records)
    assert list(cat) == [e.digest] and list(tiers.root.catalog) == []


def test_a_block_only_in_the_bucket_is_written_back_into_the_root(tiers: Tiers) -> None:
    remote = _remote(tiers)
    data, other = block(1), block(2)
    d, o = hash_bytes("blake3", data), hash_bytes("blake3", other)
    remote.blocks.put(d, [data])
    remote.blocks.put(o, [other])
    assert tiers.blocks.get(d) == data
    assert list(tiers.root.blocks.iter()) == [d]
    assert tiers.root.blocks.path(d).read_bytes() == data
    assert sorted(tiers.blocks.iter()) == sorted([d, o])


def test_a_block_in_the_bucket_larger_than_asked_is_refused_unread(tiers: Tiers) -> None:
    remote = _remote(tiers)
    data = block(3, 600)
    d = hash_bytes("blake3", data)
    remote.blocks.put(d, [data])
    with pytest.raises(CorruptBlockError, match="at most 500 bytes"):
        list(tiers.blocks.get_many([d], {d: 500}))
    assert list(tiers.root.blocks.iter()) == []


def test_a_commit_reaches_the_bucket_and_a_removal_leaves_neither(tiers: Tiers) -> None:
    remote = _remote(tiers)
    e = Entry(list(range(50, 61)), priority=2)
    assert commit(tiers, e) is True
    tiers.flush()
    got = remote.catalog.records(e.digest)
    assert got is not None
    same_records(got, e.records)
    assert {d: remote.blocks.get(d) for d in e.records.blocks} == e.bytes
    assert tiers.catalog.remove(e.digest) is True
    for root in (tiers.root, remote):
        assert root.catalog.records(e.digest) is None
        assert root.catalog.exact(e.records.exact_key) is None
        assert lookup(root.catalog, list(range(50, 61))) is None
    assert tiers.blocks.delete_many(list(e.records.blocks)) == list(e.records.blocks)
    assert list(remote.blocks.iter()) == [] and list(tiers.root.blocks.iter()) == []


def test_a_read_only_root_reads_the_bucket_without_writing_back(opened: Opened,
                                                               tiers: Tiers) -> None:
    remote = _remote(tiers)
    e = Entry(list(range(70, 78)))
    commit(remote, e)
    ro = opened.read_only_tiers(tiers)
    assert lookup(ro.catalog, list(range(70, 78))) == Match(e.digest, 8, True, True, 8,
                                                            where="remote")
    assert all(ro.blocks.get(d) == data for d, data in e.bytes.items())
    assert list(tiers.root.blocks.iter()) == [] and list(tiers.root.catalog) == []


def test_the_root_alone_answers_what_it_holds(tiers: Tiers, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """A block or entry the root holds is never asked of the bucket."""
    e = Entry(list(range(90, 99)))
    commit(tiers.root, e)
    remote = _remote(tiers)
    asked: list[str] = []
    real = remote.client.get_with_metadata
    monkeypatch.setattr(remote.client, "get_with_metadata",
                        lambda key, **kw: asked.append(key) or real(key, **kw))
    assert all(tiers.blocks.get(d) == data for d, data in e.bytes.items())
    assert tiers.catalog.records(e.digest) is not None
    assert tiers.catalog.manifest(e.digest) == (e.records.manifest, e.manifest)
    assert asked == []
