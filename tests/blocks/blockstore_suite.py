"""The shared block-store suite: every BlockStore backend passes these tests.

A backend's test module subclasses :class:`BlockStoreTests` and provides the
``store`` fixture (a fresh, empty store), :meth:`read_only` (the same blocks opened
read-only) and :meth:`corrupt`, which overwrites a stored block's bytes behind the
store's back (as a disk or a bucket can). The suite covers what the store's hot path
calls: staged writes published in a batch (a save), ``freshen``, ``open`` for reads
straight into memory (a restore), ``inspect`` and ``quarantine`` (verify and repair),
``get_many`` (a pull), and every write refused on a read-only store.
"""

from __future__ import annotations

import os
import time

import pytest

from kvstore.blocks import hash_bytes
from kvstore.blocks.base import BlockStore, Staged
from kvstore.errors import (
    BlockNotFoundError,
    CorruptBlockError,
    DigestMismatchError,
    InvalidDigestError,
    ReadOnlyStoreError,
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

    def read_only(self, store: BlockStore) -> BlockStore:
        """The blocks of ``store``, opened read-only."""
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

    def test_staged_bytes_are_invisible_until_published(self, store: BlockStore) -> None:
        data = block(20)
        d = hash_bytes(store.algo, data)
        st = store.stage([data[:10], memoryview(data)[10:]])
        assert isinstance(st, Staged) and st.size == len(data)
        assert not store.exists(d) and list(store.iter()) == []
        store.sync_staged(st)
        assert store.publish(st, d) is True
        store.sync_published([d])
        assert store.get(d) == data
        again = store.stage([b"other bytes"])  # a racing writer: nothing replaces the block
        assert store.publish(again, d) is False
        assert store.get(d) == data

    def test_put_many_puts_what_is_missing(self, store: BlockStore) -> None:
        blobs = [block(50 + i, 300) for i in range(4)]
        ds = [hash_bytes(store.algo, b) for b in blobs]
        store.put(ds[1], [blobs[1]])
        assert store.put_many([(d, [b]) for d, b in zip(ds, blobs, strict=True)]) == [
            True, False, True, True]
        assert [store.get(d) for d in ds] == blobs
        assert store.put_many([]) == []

    def test_a_discarded_stage_leaves_nothing(self, store: BlockStore) -> None:
        data = block(21)
        st = store.stage([data])
        store.discard(st)
        assert list(store.iter()) == [] and not store.exists(hash_bytes(store.algo, data))

    def test_freshen_says_whether_the_block_is_there(self, store: BlockStore) -> None:
        data = block(22)
        d = hash_bytes(store.algo, data)
        assert store.freshen(d) is False
        store.put(d, [data])
        assert store.freshen(d) is True

    def test_open_gives_a_descriptor_of_the_bytes(self, store: BlockStore) -> None:
        data = block(23)
        d = hash_bytes(store.algo, data)
        store.put(d, [data])
        fd = store.open(d, len(data))
        try:
            assert os.pread(fd, len(data) + 1, 0) == data
        finally:
            os.close(fd)
        with pytest.raises(CorruptBlockError, match=f"{len(data) + 1} bytes"):
            os.close(store.open(d, len(data) + 1))
        with pytest.raises(BlockNotFoundError):
            store.open(hash_bytes(store.algo, b"never"), 5)

    def test_inspect_tells_ok_missing_and_corrupt(self, store: BlockStore) -> None:
        data = block(24)
        d = hash_bytes(store.algo, data)
        assert store.inspect(d, len(data), read_data=False)[0] == "missing"
        store.put(d, [data])
        assert store.inspect(d, len(data), read_data=True) == ("ok", "", len(data))
        # another size than asked, yet its bytes hash to its name: good, the size lies
        # (issue 29): hashed even without read_data
        assert store.inspect(d, len(data) - 1, read_data=False) == (
            "sized", f"{len(data)} bytes hashing to its name, not {len(data) - 1}", len(data))
        bad = bytearray(data)
        bad[7] ^= 1
        self.corrupt(store, d, bytes(bad))
        state, why, _ = store.inspect(d, len(data) - 1, read_data=False)
        assert state == "corrupt" and str(len(data)) in why
        assert store.inspect(d, len(data), read_data=False)[0] == "ok"  # same size
        state, why, hashed = store.inspect(d, len(data), read_data=True)
        assert (state, hashed) == ("corrupt", len(data))
        assert hash_bytes(store.algo, bytes(bad)).hex() in why

    def test_quarantine_takes_a_block_out_of_use(self, store: BlockStore) -> None:
        data = block(25)
        d = hash_bytes(store.algo, data)
        store.put(d, [data])
        assert store.quarantine(d) is not None
        assert not store.exists(d) and d not in list(store.iter())
        with pytest.raises(BlockNotFoundError):
            store.get(d)
        assert store.quarantine(d) is None

    def test_get_many_and_iter_stats(self, store: BlockStore) -> None:
        blobs = [block(30 + i, 100 + i) for i in range(5)]
        ds = [hash_bytes(store.algo, b) for b in blobs]
        for d, b in zip(ds, blobs, strict=True):
            store.put(d, [b])
        assert list(store.get_many(ds)) == list(zip(ds, blobs, strict=True))
        assert {d: st.size for d, st in store.iter_stats()} == {
            d: len(b) for d, b in zip(ds, blobs, strict=True)}
        with pytest.raises(BlockNotFoundError):
            list(store.get_many([ds[0], hash_bytes(store.algo, b"never")]))

    def test_a_read_only_store_reads_and_refuses_every_write(self, store: BlockStore) -> None:
        data, other = block(40), block(41)
        d, o = hash_bytes(store.algo, data), hash_bytes(store.algo, other)
        store.put(d, [data])
        ro = self.read_only(store)
        assert ro.read_only and ro.get(d) == data and ro.exists(d) and list(ro.iter()) == [d]
        assert ro.inspect(d, len(data), read_data=True)[0] == "ok"
        fd = ro.open(d, len(data))
        os.close(fd)
        for write in (lambda: ro.put(o, [other]), lambda: ro.delete(d), lambda: ro.freshen(d),
                      lambda: ro.put_many([(o, [other])]),
                      lambda: ro.stage([other]), lambda: ro.quarantine(d),
                      lambda: ro.publish(Staged(pieces=[other], size=len(other)), o)):
            with pytest.raises(ReadOnlyStoreError):
                write()
        assert list(store.iter()) == [d] and store.get(d) == data
