"""Issue 29 on the real gateway: what anyone who can write the bucket puts there never costs
good data. Item 1: a manifest that gives good, shared blocks the wrong size is refused on
pull and on write-back and dropped by ``remote verify --repair``; the blocks stay, and so
does every other entry that uses them. Item 4: a pull goes on past an entry it cannot copy
and leaves none of its blocks behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli.cli_helpers import run
from helpers.hostile import halved, publish
from helpers.kv import T, make_cache, matches, open_store, tokens_for

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
