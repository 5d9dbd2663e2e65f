"""The remote tier's tests run against a real S3 gateway: a one-node Ceph RADOS Gateway
that ``tools/ceph-rgw.sh start DIR`` boots on 127.0.0.1 (CI does; locally run it, then
``eval "$(tools/ceph-rgw.sh env DIR)"``). The gateway is named by the standard
``AWS_ENDPOINT_URL``; without it these tests fail (a skipped test checks nothing).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from kvstore.remote.s3 import S3Client


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.remote)


@pytest.fixture(scope="session")
def endpoint() -> str:
    url = os.environ.get("AWS_ENDPOINT_URL")
    if not url:
        pytest.fail(
            "no S3 gateway: run `tools/ceph-rgw.sh start DIR` and "
            '`eval "$(tools/ceph-rgw.sh env DIR)"` first (CI does)'
        )
    return url


@pytest.fixture
def bucket(endpoint: str) -> Iterator[str]:
    """A fresh bucket for one test, emptied and deleted afterwards."""
    import boto3

    name = f"kvstore-test-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        c = S3Client(name)
        keys = [o.key for o in c.list("")]
        if keys:
            c.delete_many(keys)
        s3.delete_bucket(Bucket=name)


@pytest.fixture
def url(bucket: str) -> str:
    """The remote of one test: a prefix in its fresh bucket."""
    return f"s3://{bucket}/team/"


@pytest.fixture(scope="session")
def rgw_dir() -> str:
    """The gateway's directory (``tools/ceph-rgw.sh start DIR``), for the fault tests that
    kill and restart it: ``$KVSTORE_TEST_RGW_DIR`` (CI sets it)."""
    d = os.environ.get("KVSTORE_TEST_RGW_DIR")
    if not d:
        pytest.fail("the fault tests kill the gateway: set KVSTORE_TEST_RGW_DIR to the DIR "
                    "given to `tools/ceph-rgw.sh start DIR` (CI does)")
    return d
