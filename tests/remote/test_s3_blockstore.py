"""S3BlockStore against a real Ceph RADOS Gateway: the shared suite, then S3's own cases."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from blocks.blockstore_suite import BlockStoreTests, block

from kvstore.blocks import hash_bytes
from kvstore.blocks.base import BlockStore
from kvstore.remote.blocks import S3BlockStore
from kvstore.remote.errors import (
    RemoteAuthError,
    RemoteNotFoundError,
    RemoteUnavailableError,
    RemoteURLError,
)
from kvstore.remote.s3 import S3Client, parse_s3_url


class TestS3BlockStore(BlockStoreTests):
    @pytest.fixture(params=[("blake3", False), ("sha256", True)], ids=["blake3", "sha256-pool"])
    def store(self, bucket: str, request: pytest.FixtureRequest) -> Iterator[BlockStore]:
        algo, threads = request.param
        pool = ThreadPoolExecutor(4) if threads else None  # get_many on the request threads
        try:
            yield S3BlockStore(S3Client(bucket), "team/", algo, pool=pool)
        finally:
            if pool is not None:
                pool.shutdown()

    def corrupt(self, store: BlockStore, digest: bytes, data: bytes) -> None:
        assert isinstance(store, S3BlockStore)
        store.client.put(store.key(digest), data, if_absent=False)

    def read_only(self, store: BlockStore) -> BlockStore:
        assert isinstance(store, S3BlockStore)
        return S3BlockStore(store.client, store.prefix, store.algo, read_only=True)


def test_blocks_live_under_the_prefix_with_the_local_fan_out(bucket: str) -> None:
    store = S3BlockStore(S3Client(bucket), "team/", "blake3")
    data = block(7)
    d = hash_bytes("blake3", data)
    store.put(d, [data])
    keys = [o.key for o in store.client.list("")]
    assert keys == [f"team/blocks/{d.hex()[:2]}/{d.hex()}"]


def test_put_if_absent_is_honoured_by_the_gateway(bucket: str) -> None:
    """If-None-Match: * on PUT: the second writer is told the key exists (HTTP 412)."""
    c = S3Client(bucket)
    assert c.put("k", b"first") is True
    assert c.put("k", b"second") is False
    assert c.get("k") == b"first"


def test_listing_ignores_objects_that_are_not_blocks(bucket: str) -> None:
    store = S3BlockStore(S3Client(bucket), "", "blake3")
    data = block(8)
    d = hash_bytes("blake3", data)
    store.put(d, [data])
    store.client.put("blocks/zz/not-a-block", b"x")
    store.client.put(f"blocks/00/{d.hex()}", b"x")  # wrong fan-out directory
    assert list(store.iter()) == [d]


def test_a_missing_bucket_is_one_clear_error(endpoint: str) -> None:
    with pytest.raises(RemoteNotFoundError, match="kvstore-no-such-bucket.*does not exist"):
        S3Client("kvstore-no-such-bucket").check_bucket()


def test_wrong_credentials_are_one_clear_error(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(RemoteAuthError, match="s3://kvstore-auth/.*credentials refused"):
        S3Client("kvstore-auth").check_bucket()


def test_an_unreachable_endpoint_fails_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    c = S3Client("b", connect_timeout=0.5, attempts=1)
    with pytest.raises(RemoteUnavailableError, match="unreachable"):
        c.get("k")


@pytest.mark.parametrize(
    "url, bucket, prefix",
    [
        ("s3://b", "b", ""),
        ("s3://b/", "b", ""),
        ("s3://b/x/y", "b", "x/y/"),
        ("s3://b//x/", "b", "x/"),
    ],
)
def test_s3_urls(url: str, bucket: str, prefix: str) -> None:
    u = parse_s3_url(url)
    assert (u.bucket, u.prefix) == (bucket, prefix)


@pytest.mark.parametrize("url", ["http://b/x", "s3://", "s3:///x", "s3://b/../x", "s3://b/x?y"])
def test_bad_s3_urls(url: str) -> None:
    with pytest.raises(RemoteURLError):
        parse_s3_url(url)


assert os.sep == "/"  # keys are built with "/" whatever the platform
