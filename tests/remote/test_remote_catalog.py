"""The remote tier's catalog (markers and manifest objects of a bucket) passes the shared
catalog suite against the real gateway, and what only it does: every manifest read is
checked against its name, the priority travels as the manifest object's metadata."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


def test_threads_that_ask_for_one_manifest_at_once_share_one_get(
        remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup's exact probe and its bisection often read one manifest at the same moment:
    one GET serves them all, and a read that fails fails for every thread that waited."""
    e = Entry(list(range(40, 50)))
    commit(remote, e)
    fresh = RemoteCatalog(remote.client, remote.prefix, "blake3", remote.catalog.pool)
    real = remote.client.get_with_metadata
    gets: list[str] = []
    started = threading.Event()

    def slow(key: str, **kw: Any) -> tuple[bytes, dict[str, str]]:
        gets.append(key)
        started.set()
        time.sleep(0.3)  # the other threads ask meanwhile
        return real(key, **kw)

    monkeypatch.setattr(remote.client, "get_with_metadata", slow)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(fresh.manifest, e.digest)
        assert started.wait(10)
        rest = [pool.submit(fresh.manifest, e.digest) for _ in range(3)]
        got = [f.result() for f in [first, *rest]]
    assert all(g is not None and g[0] == e.records.manifest for g in got)
    assert gets == [manifest_key(remote.prefix, e.digest)]

    other = Entry(list(range(60, 70)))
    commit(remote, other)
    bad = bytearray(other.records.manifest)
    bad[-1] ^= 1
    remote.client.put(manifest_key(remote.prefix, other.digest), bytes(bad), if_absent=False)
    gets.clear()
    started.clear()
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(fresh.manifest, other.digest)
        assert started.wait(10)
        rest = [pool.submit(fresh.manifest, other.digest) for _ in range(3)]
        for f in [first, *rest]:
            with pytest.raises(DigestMismatchError):
                f.result()
    assert gets == [manifest_key(remote.prefix, other.digest)]
