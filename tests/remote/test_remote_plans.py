"""The remote's repair and compaction are plans (issue 35, item 1): ``report()`` is what
``execute()`` does, ``execute()`` runs once under the GC lease and skips what others removed
meanwhile; they delete through ``RemoteCatalog.remove_many`` and
``S3BlockStore.delete_many``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.kv import T, make_cache, open_store, tokens_for

from kvstore.remote import Remote
from kvstore.remote.errors import RemoteLeaseError
from kvstore.remote.gc import plan_compact
from kvstore.remote.verify import plan_repair


def _spoiled(tmp_path: Path, url: str) -> tuple[list[str], bytes]:
    """Two entries pushed; the second's block 2 spoiled (same size, other bytes). Returns
    the entries' ids and the spoiled block."""
    ids = []
    with open_store(tmp_path / "a", remote=url) as a:
        for seed in (31, 32):
            t = tokens_for(seed, 4 * T)
            ids.append(a.save(t, make_cache(t)).id)
        a.push(60)
        r = a.remote
        assert r is not None
        _, m = r.manifest(bytes.fromhex(ids[1]))
        bad = m.token_blocks[2]
        key = r.blocks.key(bad)
        size = r.client.head(key).size  # type: ignore[union-attr]
        r.client.put(key, b"\xff" * size, if_absent=False)
    return ids, bad


def test_a_remote_repair_plan_does_what_it_reports_once(tmp_path: Path, url: str) -> None:
    ids, bad = _spoiled(tmp_path, url)
    r = Remote(url)
    try:
        dry = plan_repair(r, read_data=True, lease=False)
        assert r.stats().lease is None
        with pytest.raises(RemoteLeaseError, match="without the lease"):
            dry.execute()
        plan = plan_repair(r, read_data=True)
        assert r.stats().lease is not None  # held by the plan
        said = plan.report()
        assert said.dry_run and said.repair and said.corrupt == [bad.hex()]
        assert (said.dropped, said.deleted_blocks) == ([ids[1]], 1)
        assert said.deleted_markers == 5  # its depth markers (4) and its exact marker
        assert r.stats().entries == 2  # reporting deletes nothing
        done = plan.execute()
        assert not done.dry_run
        assert (done.dropped, done.deleted_blocks, done.deleted_markers) == (
            said.dropped, said.deleted_blocks, said.deleted_markers)
        st = r.stats()
        assert (st.entries, st.manifests, st.lease) == (1, 1, None)
        assert r.blocks.stat(bad) is None
        with pytest.raises(RuntimeError, match="a plan is executed once"):
            plan.execute()
        assert r.stats().lease is None
        assert r.verify(read_data=True).sound
        assert [e.id for e in r.entries()] == [ids[0]]
    finally:
        r.close()


def test_a_remote_repair_plan_skips_what_others_removed(tmp_path: Path, url: str) -> None:
    ids, bad = _spoiled(tmp_path, url)
    r = Remote(url)
    try:
        plan = plan_repair(r, read_data=True)
        assert plan.report().dropped == [ids[1]] and plan.report().deleted_blocks == 1
        other = Remote(url)  # another machine removes the entry and the block meanwhile
        try:
            assert other.catalog.remove(bytes.fromhex(ids[1]))
            assert other.blocks.delete(bad)
        finally:
            other.close()
        done = plan.execute()
        assert (done.dropped, done.deleted_blocks, done.deleted_markers) == ([], 0, 0)
        assert r.stats().entries == 1 and r.verify(read_data=True).sound
    finally:
        r.close()


def test_a_remote_compaction_skips_what_others_removed(tmp_path: Path, url: str) -> None:
    with open_store(tmp_path / "a", remote=url) as a:
        ids = []
        for seed in (41, 42):
            t = tokens_for(seed, 3 * T)
            ids.append(a.save(t, make_cache(t)).id)
            a.push(60)
            time.sleep(1.1)  # LastModified has one-second resolution
        r = a.remote
        assert r is not None
        plan = plan_compact(r, max_bytes=3 * T * 64, grace=0)
        said = plan.report()
        assert (said.evicted, said.manifests_deleted, said.blocks_deleted) == ([ids[0]], 1, 3)
        other = Remote(url)
        try:
            assert other.catalog.remove(bytes.fromhex(ids[0]))
        finally:
            other.close()
        done = plan.execute()
        assert (done.evicted, done.manifests_deleted) == ([], 0)
        assert done.blocks_deleted == 3  # its blocks were still garbage: swept
        st = r.stats()
        assert (st.entries, st.blocks, st.lease) == (1, 3, None)
        assert r.verify(read_data=True).sound
