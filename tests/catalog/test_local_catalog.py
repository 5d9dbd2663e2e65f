"""The local tier's catalog (the LMDB index of a root) passes the shared catalog suite, and
what only it does: prefixes of an entry shorter than a block, the names it vouches for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from catalog.catalog_suite import CatalogTests, Entry, T, commit, lookup

from kvstore.catalog.base import Catalog, Tier
from kvstore.index import Index
from kvstore.local import Root
from kvstore.local.catalog import LocalCatalog


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Root]:
    r = Root.open(tmp_path / "r", hash="blake3", block_tokens=T, durable=False,
                  map_size=1 << 26)
    try:
        yield r
    finally:
        r.close()


class TestLocalCatalog(CatalogTests):
    @pytest.fixture
    def tier(self, root: Root) -> Tier:
        return root

    def read_only(self, tier: Tier) -> Catalog:
        assert isinstance(tier, Root)
        return LocalCatalog(Index(tier.path / "index", readonly=True))


def test_a_prefix_of_an_entry_shorter_than_a_block_is_served(root: Root) -> None:
    """The root lists trimmable entries under c_0 as well; the remote does not."""
    e = Entry([7, 8, 9])
    commit(root, e)
    got = lookup(root.catalog, [7, 8, 9, 10])
    assert got is not None and (got.digest, got.length, got.exact) == (e.digest, 3, False)


def test_the_index_vouches_for_its_own_manifests(root: Root) -> None:
    assert root.catalog.check_names is None  # only its commits wrote them


def test_the_root_remembers_an_entry_pulled_unsigned(root: Root) -> None:
    """``pulled_unsigned`` (issue 36: a keyed push must not sign what a keyless pull
    brought in) survives the commit and the read back; a record written before the field
    existed reads False."""
    import dataclasses

    import msgspec

    from kvstore.index.records import EntryRecord, decode_entry

    pulled, mine = Entry(list(range(1, 11))), Entry(list(range(20, 31)))
    assert root.catalog.commit(dataclasses.replace(pulled.records, pulled_unsigned=True),
                               lambda ds: [root.blocks.put(d, [pulled.bytes[d]]) for d in ds])
    commit(root, mine)
    got, own = root.catalog.records(pulled.digest), root.catalog.records(mine.digest)
    assert got is not None and got.pulled_unsigned is True
    assert own is not None and own.pulled_unsigned is False
    old = {"namespace": "{}", "n_tokens": 1, "logical_bytes": 2, "created_at": 3,
           "last_access": 4, "hits": 5, "priority": 2}
    rec = decode_entry(msgspec.msgpack.encode(old))
    assert rec == EntryRecord(**old) and rec.pulled_unsigned is False  # type: ignore[arg-type]
