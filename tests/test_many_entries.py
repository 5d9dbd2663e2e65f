"""Listing a root of many entries with bounded memory (issue 29, item 7)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from factories import prefix_cache

import kvstore
from kvstore.store import maintenance

NS = kvstore.Namespace(model_id="tiny-many", config_fingerprint="cfg", tokenizer_hash="tok")
OTHER = kvstore.Namespace(model_id="tiny-other", config_fingerprint="cfg", tokenizer_hash="tok")


def test_entries_are_read_a_batch_at_a_time_in_id_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With batches of 3, entries() lists each of 10 entries once, in id order, each
    namespace decoded once; an entry removed between batches is not listed."""
    monkeypatch.setattr(maintenance, "_BATCH", 3)
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=16) as s:
        ids = []
        for i in range(10):
            toks = [i + 1] * 20
            ids.append(s.save(toks, [prefix_cache(toks, mx.float16, heads=1, dim=4)],
                              namespace=OTHER if i % 4 == 0 else NS).id)
        listed = list(s.entries())
        assert [e.id for e in listed] == sorted(ids)
        assert len({id(e.namespace) for e in listed}) == 2  # one value per namespace
        assert [e.id for e in s.entries(namespace=OTHER)] == sorted(ids[::4])
        it = s.entries()
        first = [next(it) for _ in range(3)]
        last = sorted(ids)[-1]
        assert s.delete(last)
        rest = list(it)
        assert [e.id for e in first + rest] == sorted(ids)[:-1]
