"""One error per meaning: bytes that do not hash to their name are a DigestMismatchError
wherever they were read (a stored block, a manifest, a file's header, tensor or block),
carrying where, the expected digest and the one got; errors pickle (a worker's error
reaches its parent whole)."""

from __future__ import annotations

import pickle

import pytest

import kvstore
from kvstore.errors import CorruptBlockError, DigestMismatchError, KVStoreError
from kvstore.formats.errors import (
    CorruptFileBlockError,
    FileDigestMismatchError,
    FileFormatError,
    HeaderHashMismatchError,
    TensorHashMismatchError,
)


def test_a_corrupt_block_is_a_digest_mismatch() -> None:
    e = CorruptBlockError("/r/blocks/ab/abcd", "ab" * 32, "cd" * 32, digest="ab" * 32)
    assert isinstance(e, DigestMismatchError) and isinstance(e, ValueError)
    assert (e.where, e.expected, e.got, e.actual, e.path, e.digest) == (
        "/r/blocks/ab/abcd", "ab" * 32, "cd" * 32, "cd" * 32, "/r/blocks/ab/abcd", "ab" * 32)
    assert str(e) == f"/r/blocks/ab/abcd: expected {'ab' * 32}, got {'cd' * 32}"


def test_a_file_digest_mismatch_is_both_a_digest_mismatch_and_a_file_format_error() -> None:
    e = FileDigestMismatchError("/f.kv", "tensor hash mismatch", "00ff", "ff00",
                                block_path="/blocks/x")
    assert isinstance(e, DigestMismatchError) and isinstance(e, FileFormatError)
    assert (e.path, e.reason, e.where, e.expected, e.got) == (
        "/f.kv", "tensor hash mismatch", "/blocks/x", "00ff", "ff00")
    assert str(e) == "/f.kv: tensor hash mismatch"
    assert HeaderHashMismatchError is TensorHashMismatchError is FileDigestMismatchError
    b = CorruptFileBlockError("/v5.json", "KV block mismatch", "ab", "cd", block_path="/b/ab")
    assert isinstance(b, FileDigestMismatchError) and isinstance(b, CorruptBlockError)
    assert (b.path, b.where, b.digest, b.expected, b.got) == ("/v5.json", "/b/ab", "ab", "ab", "cd")


@pytest.mark.parametrize("err", [
    DigestMismatchError("s3://b/team/manifests/ab", "ab", "cd"),
    CorruptBlockError("/r/blocks/ab/abcd", "4096 bytes", "10 bytes", digest="ab" * 32),
    FileDigestMismatchError("/f.kv", "header hash mismatch", "1", "2", block_path="/b"),
    CorruptFileBlockError("/v5.json", "KV block mismatch", "ab", "cd", block_path="/b/ab"),
])
def test_errors_pickle_whole(err: KVStoreError) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert back.__dict__ == err.__dict__


def test_the_exported_errors_stay_importable_from_kvstore() -> None:
    for name in kvstore.__all__:
        if name.endswith("Error"):
            assert issubclass(getattr(kvstore, name), kvstore.KVStoreError), name
