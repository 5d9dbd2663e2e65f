"""One question asked once on the save path: the write-behind queue and ``Store.save`` share
one lookup of the root (``Store.known``) per snapshot, and a stale one stays correct."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from factories import kv_cache, kv_pair, same_bits

import kvstore
import kvstore.local.saving as saving
import kvstore.store.store as store_mod
from kvstore.mlx_lm.writebehind import WriteBehind

NS = kvstore.Namespace(model_id="tiny", config_fingerprint="cfg", tokenizer_hash="tok")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[kvstore.Store]:
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=16) as s:
        yield s


class Counted:
    """The lookups a store makes: each read transaction of its catalog (``reader``), each
    bisection (``find``) and each read transaction of its LMDB index (``reads``)."""

    def __init__(self, store: kvstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.readers = self.finds = self.reads = 0
        catalog, index = store.local.catalog, store.local.index
        real_reader, real_read = catalog.reader, index.read

        @contextmanager
        def reader() -> Iterator[Any]:
            self.readers += 1
            with real_reader() as r:
                yield r

        @contextmanager
        def read() -> Iterator[Any]:
            self.reads += 1
            with real_read() as t:
                yield t

        def counting_find(module: Any) -> Any:
            real = module.find

            def find(*a: Any, **kw: Any) -> Any:
                self.finds += 1
                return real(*a, **kw)
            return find

        monkeypatch.setattr(catalog, "reader", reader)
        monkeypatch.setattr(index, "read", read)
        for module in (saving, store_mod):  # the save's lookups and Store's own
            monkeypatch.setattr(module, "find", counting_find(module))

    def take(self) -> tuple[int, int, int]:
        got = (self.readers, self.finds, self.reads)
        self.readers = self.finds = self.reads = 0
        return got


def _extend(c: Any, n_new: int, seed: int) -> None:
    k, v = kv_pair(n_new, seed)
    c.update_and_fetch(k, v)


def test_each_write_behind_snapshot_is_looked_up_once(
    store: kvstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queued at once, deferred, saved again unchanged: one catalog read transaction, one
    bisection and one index read per snapshot (before: three bisections in three
    transactions and a fourth, the index's own, for the exact entry)."""
    wb = WriteBehind(store, queue_bytes=1 << 30, reuse_prefix=True, defer_seconds=300.0)
    counted = Counted(store, monkeypatch)
    turn1 = list(range(40))  # two full blocks of 16 and a partial one
    c = kv_cache(40, 1)
    assert wb.submit(NS, turn1, [c], "assistant") == "queued"  # holds new whole blocks
    assert wb.drain(30)
    assert counted.take() == (1, 1, 1)
    _extend(c, 30, 2)  # the next turn: reuses turn 1's two leading blocks
    turn2 = turn1 + list(range(500, 530))
    assert wb.submit(NS, turn2, [c], "assistant") == "queued"
    assert wb.drain(30)
    assert counted.take() == (1, 1, 1)
    _extend(c, 3, 3)  # less than a block more: deferred, written at the drain
    turn3 = turn2 + [7, 8, 9]
    assert wb.submit(NS, turn3, [c], "assistant") == "deferred"
    assert wb.drain(30)
    assert counted.take() == (1, 1, 1)
    # the same tokens again: found stored by the one lookup; the save only confirms the
    # entry is still there (one get of its exact key: a catalog read, no bisection)
    assert wb.submit(NS, turn3, [c], "assistant") == "deferred"
    assert wb.drain(30)
    assert counted.take() == (1, 1, 2)
    wb.close(30)
    assert wb.counters()["saved"] == 4 and "failed" not in wb.counters()
    m1 = store.manifest(store.lookup(turn1, namespace=NS).digest)  # type: ignore[union-attr]
    m2 = store.manifest(store.lookup(turn2, namespace=NS).digest)  # type: ignore[union-attr]
    assert m2.token_blocks[:2] == m1.token_blocks[:2]  # referenced, as before
    (r,), n = store.restore(turn3)
    assert n == 73 and same_bits(r.keys[..., :73, :], c.keys[..., :73, :])


def test_store_save_asks_its_catalog_once(
    store: kvstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save with ``reuse_prefix`` reads the index once, through the catalog (before:
    once for the exact entry past the catalog, once for the reusable prefix)."""
    a = list(range(40))
    c = kv_cache(40, 1)
    counted = Counted(store, monkeypatch)
    first = store.save(a, [c], reuse_prefix=True)
    assert counted.take() == (1, 1, 1)
    _extend(c, 30, 2)
    store.save(a + list(range(500, 530)), [c], reuse_prefix=True)
    assert counted.take() == (1, 1, 1)
    again = store.save(a, [kv_cache(40, 1)])  # no reuse_prefix: the exact entry only
    assert again.id == first.id and not again.created
    assert counted.take() == (1, 0, 1)


def test_a_stale_known_entry_is_saved_again(store: kvstore.Store) -> None:
    """A ``known`` that says the tokens are stored, asked before the entry was deleted:
    the save confirms it, finds it gone, and stores the cache."""
    a = list(range(40))
    first = store.save(a, [kv_cache(40, 1)])
    known = store.known(a)
    assert known.exact is not None and known.exact[0].hex() == first.id and known.stored == 40
    assert store.delete(first.id)
    c = kv_cache(40, 2)
    info = store.save(a, [c], known=known, reuse_prefix=True)
    assert info.created
    (r,), n = store.restore(a)
    assert n == 40 and same_bits(r.keys[..., :40, :], c.keys[..., :40, :])
    with pytest.raises(ValueError, match="known was asked for other tokens"):
        store.save(a + [1], [kv_cache(41, 1)], known=known)


def test_a_stale_known_prefix_whose_blocks_went_is_written_whole(
    store: kvstore.Store,
) -> None:
    """A ``known`` prefix whose entry was deleted and collected before the save: the
    commit finds the reused blocks gone and the save writes its own bytes."""
    a = list(range(48))
    old = store.save(a[:40], [kv_cache(40, 1)])
    known = store.known(a)
    assert known.stored == 40 and len(known.blocks) == 2
    store.delete(old.id)
    store.compact(grace=0)
    c = kv_cache(48, 5)
    info = store.save(a, [c], known=known, reuse_prefix=True)
    assert store.manifest(info.id).token_blocks[0] != known.blocks[0]
    (r,), n = store.restore(a)
    assert n == 48 and same_bits(r.keys[..., :48, :], c.keys[..., :48, :])
    assert store.verify(read_data=True).sound



def test_a_snapshot_whose_entry_another_writer_deleted_meanwhile_is_saved(
    store: kvstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deferred snapshot found stored when it was queued, its entry deleted by another
    handle on the root (another process) before it is written: the write-behind save
    confirms the entry, finds it gone, asks again and stores the snapshot."""
    toks = list(range(40))
    c = kv_cache(40, 1)
    first = store.save(toks, [c])
    wb = WriteBehind(store, queue_bytes=1 << 30, reuse_prefix=True, defer_seconds=300.0)
    counted = Counted(store, monkeypatch)
    assert wb.submit(NS, toks, [c], "assistant") == "deferred"  # stored: nothing new
    assert counted.take() == (1, 1, 1)
    with kvstore.Store.open(store.root, namespace=NS) as other:
        assert other.delete(first.id)
    assert wb.drain(30)
    # the confirmation (a get of the exact key), then the lookup again
    assert counted.take() == (1, 1, 2)
    wb.close(30)
    assert wb.counters()["saved"] == 1
    (r,), n = store.restore(toks)
    assert n == 40 and same_bits(r.keys[..., :40, :], c.keys[..., :40, :])
    assert store.lookup(toks).digest.hex() != first.id  # type: ignore[union-attr]


def test_a_queue_that_saved_meanwhile_asks_again(
    store: kvstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a deferred snapshot's lookup found is not reused once its queue has saved
    another snapshot (that save may hold more of its tokens): it is asked again."""
    toks = list(range(40))
    store.save(toks[:32], [kv_cache(32, 1)])
    wb = WriteBehind(store, queue_bytes=1 << 30, reuse_prefix=True, defer_seconds=300.0)
    counted = Counted(store, monkeypatch)
    c = kv_cache(40, 2)
    assert wb.submit(NS, toks, [c], "assistant") == "deferred"  # 8 more: not a block
    assert wb.submit(NS, toks[:36], [kv_cache(36, 3)], "checkpoint") == "queued"
    assert wb.drain(30)
    wb.close(30)
    assert wb.counters()["saved"] == 2
    # the snapshot's lookup at submit, the checkpoint's at its save, the snapshot's again
    assert counted.take()[:2] == (3, 3)
    (r,), n = store.restore(toks)  # its own rows past the two blocks it referenced
    assert n == 40 and same_bits(r.keys[..., 32:40, :], c.keys[..., 32:40, :])
