"""Issue 29, item 4 (local half): an entry copied into a root that is not committed leaves
none of the blocks it wrote (``Root.take``). A download that fails part way publishes
nothing (the blocks are staged in ``tmp/`` until all are in); a commit that fails after
they were published unlinks those that no entry references. The gateway half (a pull that
goes on past a truncated block) is ``tests/remote/test_remote_hostile.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.kv import T, make_cache, open_store, sound_store, tokens_for

from kvstore.errors import CorruptBlockError, KVStoreError


def _entry(tmp_path: Path) -> tuple[object, list[int]]:
    src = open_store(tmp_path / "src")
    toks = tokens_for(1, 5 * T + 3, shared=2 * T)
    src.save(toks, make_cache(toks))
    return src, toks


def test_a_failed_commit_unlinks_the_blocks_it_wrote(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    src, toks = _entry(tmp_path)
    with src, open_store(tmp_path / "dst") as dst:  # type: ignore[attr-defined]
        other = tokens_for(2, 3 * T, shared=2 * T)  # shares the first 2 blocks
        dst.save(other, make_cache(other))
        before = {d for d, _ in dst.local.block_files()}
        rec = src.local.catalog.records(bytes.fromhex(src.lookup(toks).entry_id))
        assert rec is not None and len(rec.blocks) == 6

        def fail(*a: object, **k: object) -> bool:
            raise KVStoreError("the commit failed")

        monkeypatch.setattr(dst.local.catalog, "commit", fail)
        with pytest.raises(KVStoreError, match="the commit failed"):
            dst.local.take(rec, src.local.blocks)
        monkeypatch.undo()
        # its 4 own blocks were published, then unlinked; the 2 shared ones are untouched
        assert {d for d, _ in dst.local.block_files()} == before
        sound_store(dst)
        got = dst.local.take(rec, src.local.blocks)  # and it copies whole afterwards
        assert (got.created, got.blocks, got.present) == (True, 4, 2)


def test_a_failed_download_publishes_nothing(tmp_path: Path) -> None:
    src, toks = _entry(tmp_path)
    with src, open_store(tmp_path / "dst") as dst:  # type: ignore[attr-defined]
        m = src.manifest(src.lookup(toks).entry_id)
        rec = src.local.catalog.records(bytes.fromhex(src.lookup(toks).entry_id))
        assert rec is not None
        bad = bytes(m.token_blocks[4])
        path = src.local.blocks.path(bad)
        path.chmod(0o644)
        data = path.read_bytes()
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(CorruptBlockError):
            dst.local.take(rec, src.local.blocks)
        assert list(dst.local.block_files()) == []
        assert list((tmp_path / "dst" / "tmp").iterdir()) == []
        assert list(dst.entries()) == []
