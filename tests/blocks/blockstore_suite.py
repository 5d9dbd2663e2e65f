"""The shared block-store suite: every BlockStore backend passes these tests.

A backend's test module subclasses :class:`BlockStoreTests` and provides the
``store`` fixture (a fresh, empty store) and :meth:`corrupt`, which overwrites a
stored block's bytes behind the store's back (as a disk or a bucket can).
"""

from __future__ import annotations

import time

import pytest

from kvstore.blocks import hash_bytes
from kvstore.blocks.base import BlockStore
from kvstore.errors import (
    BlockNotFoundError,
    CorruptBlockError,
    DigestMismatchError,
    InvalidDigestError,
)


def block(seed: int, n: int = 4096) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(n))


class BlockStoreTests:
    """Subclass me; override ``store`` and ``corrupt``."""

    @pytest.fixture
    def store(self) -> BlockStore:
        raise NotImplementedError

    def corrupt(self, store: BlockStore, digest: bytes, data: bytes) -> None:
        raise NotImplementedError

    def test_put_then_get_returns_the_same_bytes(self, store: BlockStore) -> None:
        data = block(1)
        d = hash_bytes(store.algo, data)
        assert store.put(d, [data[:1000], memoryview(data)[1000:]]) is True
        assert store.get(d) == data
        assert store.exists(d)
        st = store.stat(d)
        assert st is not None and st.size == len(data)

    def test_an_existing_block_is_not_rewritten(self, store: BlockStore) -> None:
        data = block(2)
        d = hash_bytes(store.algo, data)
        assert store.put(d, [data]) is True
        assert store.put(d, [data]) is False
        assert store.get(d) == data

    def test_a_missing_block_is_block_not_found(self, store: BlockStore) -> None:
        d = hash_bytes(store.algo, b"never stored")
        assert not store.exists(d)
        assert store.stat(d) is None
        with pytest.raises(BlockNotFoundError):
            store.get(d)

    def test_corrupt_bytes_are_caught_with_both_digests(self, store: BlockStore) -> None:
        data = block(3)
        d = hash_bytes(store.algo, data)
        store.put(d, [data])
        bad = bytearray(data)
        bad[100] ^= 0xFF
        self.corrupt(store, d, bytes(bad))
        with pytest.raises(CorruptBlockError) as e:
            store.get(d)
        assert d.hex() in str(e.value) and hash_bytes(store.algo, bytes(bad)).hex() in str(e.value)
        assert isinstance(e.value, DigestMismatchError)
        assert (e.value.where, e.value.expected, e.value.got) == (
            store.where(d), d.hex(), hash_bytes(store.algo, bytes(bad)).hex())
        assert store.get(d, verify=False) == bytes(bad)

    def test_read_into_copies_a_range(self, store: BlockStore) -> None:
        data = block(4)
        d = hash_bytes(store.algo, data)
        store.put(d, [data])
        out = bytearray(100)
        store.read_into(d, 50, memoryview(out))
        assert bytes(out) == data[50:150]

    def test_delete_and_iter(self, store: BlockStore) -> None:
        blobs = [block(10 + i, 512) for i in range(3)]
        ds = [hash_bytes(store.algo, b) for b in blobs]
        for d, b in zip(ds, blobs, strict=True):
            store.put(d, [b])
        assert sorted(store.iter()) == sorted(ds)
        assert store.delete(ds[0]) is True
        assert store.delete(ds[0]) is False
        assert not store.exists(ds[0])
        assert sorted(store.iter()) == sorted(ds[1:])

    def test_stat_mtime_is_recent(self, store: BlockStore) -> None:
        data = block(5)
        d = hash_bytes(store.algo, data)
        store.put(d, [data])
        st = store.stat(d)
        assert st is not None and abs(st.mtime - time.time()) < 300

    @pytest.mark.parametrize(
        "bad", [b"../../config", b"\x00" * 31, b"\x00" * 33, "ab" * 32]
    )
    def test_invalid_digests_are_refused_before_any_path_or_key(
        self, store: BlockStore, bad: object
    ) -> None:
        for op in (store.exists, store.get, store.stat, store.delete):
            with pytest.raises(InvalidDigestError):
                op(bad)  # type: ignore[operator]
