"""The remote tier's catalog (markers and manifest objects of a bucket) passes the shared
catalog suite against the real gateway, and what only it does: every manifest read is
checked against its name, the priority travels as the manifest object's metadata."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from catalog.catalog_suite import CatalogTests, Entry, T, commit, lookup

from kvstore.catalog.base import Catalog, Tier
from kvstore.catalog.settings import TierSettings
from kvstore.errors import DigestMismatchError
from kvstore.remote import Remote
from kvstore.remote.catalog import RemoteCatalog
from kvstore.remote.layout import manifest_key


@pytest.fixture
def remote(url: str) -> Iterator[Remote]:
    r = Remote(url)
    r.attach(TierSettings(hash="blake3", block_tokens=T, state_block_bytes=4 << 20,
                          created_at=1), create=True)
    try:
        yield r
    finally:
        r.close()


class TestRemoteCatalog(CatalogTests):
    @pytest.fixture
    def tier(self, remote: Remote) -> Tier:
        return remote

    def read_only(self, tier: Tier) -> Catalog:
        assert isinstance(tier, Remote)
        return RemoteCatalog(tier.client, tier.prefix, "blake3", tier.catalog.pool,
                             read_only=True)


def test_a_manifest_that_does_not_match_its_name_is_refused(remote: Remote) -> None:
    e = Entry(list(range(10)))
    commit(remote, e)
    bad = bytearray(e.records.manifest)
    bad[-1] ^= 1
    remote.client.put(manifest_key(remote.prefix, e.digest), bytes(bad), if_absent=False)
    fresh = RemoteCatalog(remote.client, remote.prefix, "blake3", remote.catalog.pool)
    with pytest.raises(DigestMismatchError) as err:
        fresh.manifest(e.digest)
    assert err.value.expected == e.digest.hex() and e.digest.hex() in err.value.where
    assert lookup(fresh, list(range(10)) + [1]) is None  # a bad manifest is no match


def test_the_priority_is_the_manifest_objects_metadata(remote: Remote) -> None:
    e = Entry(list(range(20, 30)), priority=2)
    commit(remote, e)
    key = manifest_key(remote.prefix, e.digest)
    assert remote.client.get_with_metadata(key)[1] == {"priority": "2"}
    remote.client.put(key, e.records.manifest, if_absent=False)  # as an older kvstore put it
    fresh = RemoteCatalog(remote.client, remote.prefix, "blake3", remote.catalog.pool)
    got = fresh.records(e.digest)
    assert got is not None and got.priority == 0  # none kept: the manifest says assistant
