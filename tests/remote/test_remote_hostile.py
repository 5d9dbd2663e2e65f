"""Issue 29 on the real gateway: what anyone who can write the bucket puts there never costs
good data. Item 1: a manifest that gives good, shared blocks the wrong size is refused on
pull and on write-back and dropped by ``remote verify --repair``; the blocks stay, and so
does every other entry that uses them. Item 4: a pull goes on past an entry it cannot copy
and leaves none of its blocks behind.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
from cli.cli_helpers import run
from helpers.hostile import assert_nothing_good_lost, halved, publish
from helpers.kv import T, make_cache, matches, open_store, sound_store, tokens_for

import kvstore
from kvstore.catalog.records import Records

SYSTEM = 3 * T  # the prompt the three good entries share: 3 shared blocks
N = SYSTEM + 2 * T + 5


def _seed(tmp_path: Path, url: str) -> tuple[list[list[int]], set[str], set[bytes], Records,
                                              list[int]]:
    """Three good entries under one system prompt, pushed; then a fourth manifest that
    names the first one's blocks at half their size (published with its markers).
    Returns the good tokens, their ids, their blocks, the lie and its tokens."""
    good = [tokens_for(seed, N, shared=SYSTEM) for seed in (1, 2, 3)]
    with open_store(tmp_path / "a", remote=url) as a:
        for t in good:
            a.save(t, make_cache(t))
        assert a.push(60).entries == 3
        ids = {e.id for e in a.entries()}
        blocks = {b for e in ids for b in a.manifest(e).block_digests()}
        m = a.manifest(a.lookup(good[0]).entry_id)  # type: ignore[union-attr]
        lie_toks = tokens_for(9, N, shared=SYSTEM)
        assert a.remote is not None
        lie = publish(a.remote, halved(m, lie_toks))
    return good, ids, blocks, lie, lie_toks


def _remote_state(url: str) -> tuple[set[str], set[bytes]]:
    r = kvstore.remote.Remote(url)
    try:
        return {d.hex() for d in r.catalog}, set(r.blocks.iter())
    finally:
        r.close()


def _restores(tmp_path: Path, url: str, good: list[list[int]]) -> None:
    """A fresh machine restores every good entry bit for bit."""
    with open_store(tmp_path / "fresh", remote=url) as f:
        for t in good:
            cache, n = f.restore(t)
            assert n == len(t) and cache is not None and matches(cache, t, n)


@pytest.mark.parametrize("read_data", [True, False], ids=["read-data", "sizes"])
def test_verify_repair_drops_the_lying_manifest_and_no_good_block(
    tmp_path: Path, url: str, read_data: bool
) -> None:
    good, ids, blocks, lie, _ = _seed(tmp_path, url)
    with open_store(tmp_path / "a", remote=url) as a:
        assert a.remote is not None
        rep = a.remote.verify(read_data=read_data)
        assert not rep.sound and rep.corrupt == [] and rep.bad_manifests == []
        # every block the lie names is good and twice the size it claims
        assert rep.lying == {lie.digest.hex(): sorted(b.hex() for b in lie.blocks)}
        assert rep.wrong_size == sorted(b.hex() for b in lie.blocks)
        rep = a.remote.verify(read_data=read_data, repair=True)
        assert rep.dropped == [lie.digest.hex()] and rep.deleted_blocks == 0
        assert a.remote.verify(read_data=True).sound
    assert _remote_state(url) == (ids, blocks)
    _restores(tmp_path, url, good)
    r = run("--root", tmp_path / "a", "--remote", url, "remote", "verify", "--read-data")
    assert r.code == 0 and "sound" in r.out, r


def test_a_pull_refuses_the_lying_manifest_and_goes_on(tmp_path: Path, url: str) -> None:
    """Pulled into a root that holds the good entries: the lie is refused (before, the pull
    exited 0 and a restore of its prompt then quarantined the shared block and dropped every
    local entry that uses it); the good ones are all there and restore bit for bit."""
    good, ids, blocks, lie, lie_toks = _seed(tmp_path, url)
    b = tmp_path / "b"
    with open_store(b, remote=url) as s:
        for t in good:
            s.save(t, make_cache(t))
        ids = {e.id for e in s.entries()}  # the same tokens and blocks, saved here
    r = run("--root", b, "--remote", url, "pull", "--json")
    assert r.code == 2 and "Traceback" not in r.err, r
    got = r.json()
    assert {p["id"] for p in got["pulled"]} == ids
    assert list(got["failed"]) == [lie.digest.hex()]
    assert "the entry is refused, the block kept" in got["failed"][lie.digest.hex()]
    assert "kvstore: error: 1 entry could not be pulled" in r.err
    with open_store(b, remote=url) as s:
        assert {e.id for e in s.entries()} == ids
        cache, n = s.restore(lie_toks)  # the lie is the remote's longest match: refused
        assert n == SYSTEM and cache is not None and matches(cache, lie_toks, n)
        assert_nothing_good_lost(s, b, ids, blocks, good)


def test_a_write_back_into_an_empty_root_refuses_the_lie(tmp_path: Path, url: str) -> None:
    """No block of the lie is here yet: each download is checked against the size the
    manifest gives it, so nothing of the lie is committed or left behind."""
    good, ids, blocks, lie, lie_toks = _seed(tmp_path, url)
    with open_store(tmp_path / "c", remote=url) as s:
        cache, n = s.restore(lie_toks)
        assert (cache, n) == (None, 0)
        assert list(s.entries()) == [] and list(s.local.block_files()) == []
        rep = s.pull([e[:12] for e in sorted(ids)])
        assert rep.failed == {} and {p.digest.hex() for p in rep.pulled} == ids
        assert {d for d, _ in s.local.block_files()} == blocks
        rep = s.pull([lie.digest.hex()])
        assert rep.pulled == [] and list(rep.failed) == [lie.digest.hex()]
        assert {d for d, _ in s.local.block_files()} == blocks
        for t in good:
            cache, n = s.restore(t)
            assert n == len(t) and cache is not None and matches(cache, t, n)


def test_a_pull_goes_on_past_a_truncated_block_and_leaves_nothing_behind(
    tmp_path: Path, url: str
) -> None:
    """Item 4: three entries of their own blocks; the second's fourth block is truncated on
    the remote. The pull copies the first and the third, reports the second, and none of
    the second's blocks is left in the root (its blocks are staged in tmp/ and published
    only once all of them are in; a commit that fails unlinks what it published)."""
    toks = [tokens_for(seed, 6 * T) for seed in (4, 5, 6)]
    with open_store(tmp_path / "a", remote=url) as a:
        for t in toks:
            a.save(t, make_cache(t))
        assert a.push(60).entries == 3
        ms = [a.manifest(a.lookup(t).entry_id) for t in toks]  # type: ignore[union-attr]
        ids = [a.lookup(t).entry_id for t in toks]  # type: ignore[union-attr]
        r = a.remote
        assert r is not None
        cut = bytes(ms[1].token_blocks[3])
        key, where = r.blocks.key(cut), r.blocks.url(cut)
        r.client.put(key, r.client.get(key)[:100], if_absent=False)
    with open_store(tmp_path / "b", remote=url) as s:
        rep = s.pull()
        assert sorted(p.digest.hex() for p in rep.pulled) == sorted([ids[0], ids[2]])
        assert list(rep.failed) == [ids[1]]
        assert rep.failed[ids[1]].startswith(f"{where}: expected {cut.hex()}, got ")
        assert {d for d, _ in s.local.block_files()} == {
            bytes(b) for m in (ms[0], ms[2]) for b in m.block_digests()}
        assert list((tmp_path / "b" / "tmp").iterdir()) == []
        for i in (0, 2):
            cache, n = s.restore(toks[i])
            assert n == len(toks[i]) and cache is not None and matches(cache, toks[i], n)
        sound_store(s)


def test_a_block_object_larger_than_its_manifest_says_is_refused_unread(
    tmp_path: Path, url: str
) -> None:
    """A good entry whose third block object was replaced by 64 MiB: a pull refuses the
    entry from the object's length and never holds its body (before, it was read whole,
    then found corrupt)."""
    toks = tokens_for(7, 4 * T)
    with open_store(tmp_path / "a", remote=url) as a:
        eid = a.save(toks, make_cache(toks)).id
        assert a.push(60).entries == 1
        m = a.manifest(eid)
        r = a.remote
        assert r is not None
        big = bytes(m.token_blocks[2])
        size = r.client.head(r.blocks.key(big)).size  # type: ignore[union-attr]
        r.client.put(r.blocks.key(big), bytes(64 << 20), if_absent=False)
        where = r.blocks.url(big)
    with open_store(tmp_path / "b", remote=url) as s:
        tracemalloc.start()
        try:
            rep = s.pull()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert rep.pulled == [] and list(rep.failed) == [eid]
        assert rep.failed[eid] == (f"{where}: expected at most {size} bytes, got "
                                   f"{64 << 20} bytes (not read)")
        assert peak < 16 << 20, f"{peak} bytes allocated"
        assert list(s.local.block_files()) == [] and list(s.entries()) == []
