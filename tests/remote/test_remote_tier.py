"""The remote tier against the real gateway: two machines on one bucket, dedup across
machines, the compaction race, settings, verify and compact (docs/FORMAT.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from catalog.catalog_suite import same_records
from helpers.kv import T, make_cache, matches, open_store, run_worker, start_worker, tokens_for

import kvstore
from kvstore.catalog.records import records_of
from kvstore.errors import RootSettingsError
from kvstore.remote import Remote
from kvstore.remote.errors import RemoteLeaseError
from kvstore.remote.gc import plan_compact


def count_requests(store: kvstore.Store) -> list[str]:
    """Every S3 request the store's remote client makes from now on, by operation name."""
    seen: list[str] = []
    assert store.remote is not None
    store.remote.client._s3.meta.events.register(
        "before-call.s3", lambda model, **kw: seen.append(model.name))
    return seen


def remote_objects(url: str, kind: str) -> dict[str, int]:
    r = Remote(url)
    try:
        return {o.key: o.size for o in r.client.list(r.prefix + kind)}
    finally:
        r.close()


def test_two_machines_share_an_entry(tmp_path: Path, url: str) -> None:
    toks = tokens_for(1, 10 * T + 5, shared=3 * T)
    rc, out, err = run_worker("remote-save", {"root": str(tmp_path / "a"), "remote": url,
                                              "seeds": [1], "n": len(toks), "shared": 3 * T})
    assert rc == 0, err
    assert out is not None and out["entries"] == 1 and out["blocks"] == 11 and out["failed"] == 0
    query = toks + [7, 8, 9]
    with open_store(tmp_path / "b", remote=url) as b:
        m = b.lookup(query)
        assert m is not None and m.where == "remote" and m.length == len(toks)
        assert m.entry_id == out["ids"][0] and not m.exact
        cache, n = b.restore(query)
        assert n == len(toks) and cache is not None and matches(cache, query, n)
        assert b.stats().entries == 1  # committed locally
        seen = count_requests(b)
        cache, n = b.restore(query)
        assert n == len(toks) and cache is not None and matches(cache, query, n)
        # it downloads nothing; it only asks whether the remote holds a longer prefix:
        # the exact key and one depth marker
        assert seen == ["ListObjectsV2"] * 2, seen
        m = b.lookup(query)
        assert m is not None and m.where == "local"
        seen.clear()
        cache, n = b.restore(toks)  # an exact local hit does not ask at all
        assert n == len(toks) and cache is not None and matches(cache, toks, n)
        assert seen == [], f"an exact local hit asked the remote: {seen}"


def test_a_prefix_pull_downloads_only_the_blocks_it_needs(tmp_path: Path, url: str) -> None:
    long = tokens_for(2, 20 * T, shared=0)
    with open_store(tmp_path / "a", remote=url) as a:
        a.save(long, make_cache(long))
        assert a.push(60).blocks == 20
    query = long[: 6 * T + 3] + [1, 2]  # shares 6 blocks and 3 tokens of the 7th
    with open_store(tmp_path / "b", remote=url) as b:
        seen = count_requests(b)
        cache, n = b.restore(query)
        assert n == 6 * T + 3 and cache is not None and matches(cache, query, n)
        assert seen.count("GetObject") == 1 + 7  # the manifest, then 7 of its 20 blocks
        (e,) = list(b.entries())
        assert e.n_tokens == 7 * T  # the local entry is the prefix, cut at a block boundary
        assert len(list(b.local.blocks.iter())) == 7


def test_a_pulled_entry_keeps_its_records(tmp_path: Path, url: str) -> None:
    """A system prompt saved on one machine is a system prompt on the machine that pulls it:
    both roots record it as records_of of the same manifest, priority included (whole, and
    cut back to the prefix a query needs)."""
    toks = tokens_for(5, 6 * T + 4)
    with open_store(tmp_path / "a", remote=url) as a:
        eid = a.save(toks, make_cache(toks), priority="system").id  # no cache_type metadata
        assert a.push(60).entries == 1
        mine = a.local.catalog.records(bytes.fromhex(eid))
    with open_store(tmp_path / "b", remote=url) as b:
        cache, n = b.restore(toks)
        assert cache is not None and n == len(toks) and matches(cache, toks, n)
        (e,) = list(b.entries())
        assert (e.id, e.priority) == (eid, "system")
        theirs = b.local.catalog.records(bytes.fromhex(eid))
        assert mine is not None and theirs is not None
        same_records(theirs, mine)
        assert theirs.last_access >= mine.last_access
    with open_store(tmp_path / "c", remote=url) as c:
        q = toks[: 3 * T + 2] + [1, 2]
        cache, n = c.restore(q)
        assert cache is not None and n == 3 * T + 2 and matches(cache, q, n)
        (e,) = list(c.entries())
        assert (e.n_tokens, e.priority) == (4 * T, "system")
        cut = c.local.catalog.records(bytes.fromhex(e.id))
        assert cut is not None
        same_records(cut, records_of(c.manifest(e.id), priority=2, last_access=cut.last_access))


def test_dedup_across_20_machines(tmp_path: Path, url: str) -> None:
    system = 4096
    seeds = list(range(20))
    n = system + 2 * T + 5
    procs = [start_worker("remote-save", {"root": str(tmp_path / f"m{i}"), "remote": url,
                                          "seeds": seeds[i::4], "n": n, "shared": system})
             for i in range(4)]  # 4 processes, 5 machines' roots each by seed
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    blocks = remote_objects(url, "blocks/")
    per_user = -(-(n - system) // T)
    assert len(blocks) == system // T + 20 * per_user
    row = 2 * 2 * 8 * 2  # one token's K and V rows: H=2, D=8, fp16
    assert sum(blocks.values()) == system * row + 20 * (n - system) * row
    with open_store(tmp_path / "fresh", remote=url) as s:
        for seed in (0, 13):
            q = tokens_for(seed, n, shared=system)
            m = s.lookup(q)
            assert m is not None and m.where == "remote" and m.exact


def test_settings_must_match(tmp_path: Path, url: str) -> None:
    with open_store(tmp_path / "a", remote=url):
        pass
    with pytest.raises(RootSettingsError, match="block_tokens: local 32 vs remote 16"):
        kvstore.Store.open(tmp_path / "b", namespace=None, block_tokens=32, remote=url)
    with kvstore.Store.open(tmp_path / "c", remote=url) as s:  # a new root takes the remote's
        assert s.local.settings.block_tokens == T


def test_verify_finds_and_repairs_a_corrupt_block(tmp_path: Path, url: str) -> None:
    toks = tokens_for(3, 4 * T)
    with open_store(tmp_path / "a", remote=url) as a:
        a.save(toks, make_cache(toks))
        a.push(60)
        assert a.remote is not None
        r = a.remote
        assert r.verify(read_data=True).sound
        _, m = r.manifest(a.lookup(toks).digest)  # type: ignore[union-attr]
        bad = m.token_blocks[2]
        key = r.blocks.key(bad)
        size = r.client.head(key).size  # type: ignore[union-attr]
        r.client.put(key, b"\xff" * size, if_absent=False)  # same size, other bytes
        assert r.verify().sound  # structure only: sizes match
        rep = r.verify(read_data=True)
        assert not rep.sound and rep.corrupt == [bad.hex()]
    with open_store(tmp_path / "b", remote=url) as b:
        cache, n = b.restore(toks)
        assert cache is None and n == 0  # never the bad bytes
        assert not b.local.blocks.exists(bad)
        assert b.remote is not None
        rep = b.remote.verify(read_data=True, repair=True)
        assert len(rep.dropped) == 1 and rep.deleted_blocks == 1
        assert b.remote.verify(read_data=True).sound
        assert b.remote.stats().entries == 0


def test_compact_evicts_lru_and_sweeps(tmp_path: Path, url: str) -> None:
    with open_store(tmp_path / "a", remote=url) as a:
        ids = []
        for seed in (10, 11, 12):
            t = tokens_for(seed, 3 * T, shared=T)
            ids.append(a.save(t, make_cache(t)).id)
            a.push(60)
            time.sleep(1.1)  # LastModified has one-second resolution
        r = a.remote
        assert r is not None
        one = 3 * T * 64 - T * 64  # the bytes of one entry's own blocks
        dry = r.compact(max_bytes=T * 64 + 2 * one, grace=0, dry_run=True)
        assert dry.evicted == [ids[0]] and dry.blocks_deleted == 2
        assert r.stats().entries == 3  # a dry run deletes nothing
        rep = r.compact(max_bytes=T * 64 + 2 * one, grace=0)
        assert rep.evicted == [ids[0]] and rep.blocks_deleted == 2 and rep.bytes_deleted == one
        assert rep.live_bytes == T * 64 + 2 * one
        st = r.stats()
        assert (st.entries, st.manifests, st.blocks, st.lease) == (2, 2, 5, None)
        assert r.verify(read_data=True).sound
        rep = r.compact(grace=3600)
        assert rep.blocks_deleted == 0 and rep.evicted == []


def test_a_remote_compaction_is_a_plan_run_once(tmp_path: Path, url: str) -> None:
    """The plan to execute holds the lease from before its listing until its execution
    ends; it deletes what its report says; it runs once; a dry run's plan (listed without
    the lease) cannot be executed."""
    with open_store(tmp_path / "a", remote=url) as a:
        ids = []
        for seed in (20, 21):
            t = tokens_for(seed, 3 * T)
            ids.append(a.save(t, make_cache(t)).id)
            a.push(60)
            time.sleep(1.1)  # LastModified has one-second resolution
        r = a.remote
        assert r is not None
        dry = plan_compact(r, max_bytes=0, grace=0, lease=False)
        assert dry.report().evicted == ids and r.stats().lease is None
        with pytest.raises(RemoteLeaseError):
            dry.execute()
        plan = plan_compact(r, max_bytes=3 * T * 64, grace=0)
        assert r.stats().lease is not None  # held by the plan
        planned = plan.report()
        assert planned.dry_run and planned.evicted == [ids[0]] and planned.blocks_deleted == 3
        done = plan.execute()
        assert not done.dry_run and (done.evicted, done.blocks_deleted) == ([ids[0]], 3)
        st = r.stats()
        assert (st.entries, st.blocks, st.lease) == (1, 3, None)
        with pytest.raises(RuntimeError, match="once"):
            plan.execute()
        assert r.verify(read_data=True).sound


def test_the_compaction_race(tmp_path: Path, url: str) -> None:
    """A saves entries reusing blocks already on the remote while B compacts at grace 0 in
    a loop, evicting down to a small budget (so A's blocks are swept under it); every
    entry left restores bit-exact on an empty root and the remote verifies."""
    system = 8 * T
    with open_store(tmp_path / "seed", remote=url) as s0:
        t = tokens_for(100, system + T, shared=system)
        s0.save(t, make_cache(t))
        assert s0.push(60).failed == 0
    until = time.time() + 25
    budget = (system + 4 * T) * 64
    b = start_worker("remote-compact", {"remote": url, "until": until, "max_bytes": budget})
    a = start_worker("remote-save", {"root": str(tmp_path / "a"), "remote": url,
                                     "seeds": list(range(40)), "n": system + 2 * T,
                                     "shared": system, "push_each": True})
    a_out, a_err = a.communicate(timeout=300)
    b_out, b_err = b.communicate(timeout=300)
    assert a.returncode == 0 and b.returncode == 0, (a_err[-3000:], b_err[-3000:])
    sa = json.loads(a_out.strip().splitlines()[-1])
    sb = json.loads(b_out.strip().splitlines()[-1])
    assert sa["failed"] == 0 and sa["entries"] == 40
    assert sb["passes"] >= 3 and sb["evicted"] > 0 and sb["deleted"] > 0, sb
    r = Remote(url)
    try:
        assert r.verify(read_data=True).sound
        left = [e for e in r.entries() if e.complete]
    finally:
        r.close()
    assert left, "the budget keeps the newest entries"
    with open_store(tmp_path / "c", remote=url) as c:
        for seed in range(40):
            q = tokens_for(seed, system + 2 * T, shared=system)
            m = c.lookup(q)
            if m is not None and m.where == "remote" and m.exact:
                cache, n = c.restore(q)
                assert cache is not None and n == len(q) and matches(cache, q, n)
        assert sum(1 for _ in c.entries()) >= len(left) - 1


@pytest.mark.parametrize("deadline", [None, 60.0])
def test_a_pull_asks_the_root_once_per_block(tmp_path: Path, url: str,
                                             deadline: float | None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With a deadline or without, a hit below the root is written back by one route
    (Tiers.fetch): each block is looked for in the root once (Root.lacking), not once to
    size the wait and again by Root.take."""
    toks = tokens_for(3, 6 * T, shared=0)
    with open_store(tmp_path / "a", remote=url) as a:
        a.save(toks, make_cache(toks))
        assert a.push(60).blocks == 6
    with open_store(tmp_path / "b", remote=url, remote_deadline=deadline) as b:
        asked: list[tuple[str, bytes]] = []
        blocks = b.local.blocks
        for name in ("inspect", "exists"):
            real = getattr(blocks, name)
            monkeypatch.setattr(blocks, name, lambda d, *a, _r=real, _n=name, **k:
                                (asked.append((_n, d)), _r(d, *a, **k))[1])
        cache, n = b.restore(toks)
        assert n == len(toks) and cache is not None and matches(cache, toks, n)
        looked = [d for name, d in asked if name == "inspect"]
        assert len(looked) == 6 and len(set(looked)) == 6, [n for n, _ in asked]
        # beside: put_many skips a block written meanwhile, the commit fetches one a GC took
        assert [n for n, _ in asked].count("exists") == 2 * 6, [n for n, _ in asked]
        v = b.counters.values()
        assert (v.remote_pulls, v.remote_errors, v.remote_deadline_misses) == (1, 0, 0), v
