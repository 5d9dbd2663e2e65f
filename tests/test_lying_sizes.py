"""Issue 29, item 1 (local half): a manifest that gives good blocks the wrong size is the bad
party. A restore of it drops that entry alone: the blocks stay where they are and every
other entry that shares them restores bit for bit. Before, the restore quarantined the
shared block and dropped or cut back every entry that needs it.

The remote half (pull, write-back, ``remote verify --repair``) is
``tests/remote/test_remote_hostile.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hostile import assert_nothing_good_lost, halved
from helpers.kv import T, make_cache, matches, open_store, tokens_for

from kvstore.catalog.records import records_of
from kvstore.local import verify as local_verify

SYSTEM = 3 * T  # a system prompt the entries share: its 3 blocks are shared


def _three(s: object, n: int = SYSTEM + 2 * T + 5) -> list[list[int]]:
    toks = [tokens_for(seed, n, shared=SYSTEM) for seed in (1, 2, 3)]
    for t in toks:
        s.save(t, make_cache(t))  # type: ignore[attr-defined]
    return toks


def test_a_restore_drops_the_lying_entry_and_keeps_the_good_blocks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with open_store(root) as s:
        good = _three(s)
        ids = {e.id for e in s.entries()}
        m = s.manifest(s.lookup(good[0]).entry_id)  # type: ignore[union-attr]
        blocks = {b for e in ids for b in s.manifest(e).block_digests()}
        hostile_toks = tokens_for(9, m.n_tokens, shared=SYSTEM)
        lie = records_of(halved(m, hostile_toks))
        assert s.local.catalog.commit(lie, lambda ds: None)
        assert s.lookup(hostile_toks).entry_id == lie.digest.hex()  # type: ignore[union-attr]

        cache, n = s.restore(hostile_toks)
        # the lying entry is gone; the longest good prefix is the shared system prompt
        assert n == SYSTEM and cache is not None and matches(cache, hostile_toks, SYSTEM)
        assert_nothing_good_lost(s, root, ids, blocks, good)


@pytest.mark.parametrize("read_data", [False, True], ids=["sizes", "read-data"])
def test_local_verify_repair_drops_the_lying_manifest_only(tmp_path: Path,
                                                             read_data: bool) -> None:
    """Before, verify called the second of two manifests that disagree on a block's size bad
    (whichever it was) and repair dropped none of them; a lying size read first made the
    good block 'corrupt', moved aside with every entry that needs it."""
    root = tmp_path / "root"
    with open_store(root) as s:
        good = _three(s)
        ids = {e.id for e in s.entries()}
        blocks = {d for d, _ in s.local.block_files()}
        m = s.manifest(s.lookup(good[0]).entry_id)  # type: ignore[union-attr]
        lie = records_of(halved(m, tokens_for(9, m.n_tokens, shared=SYSTEM)))
        assert s.local.catalog.commit(lie, lambda ds: None)
        rep = local_verify.verify(s.local, read_data=read_data)
        assert rep.bad_manifests == [lie.digest.hex()] and rep.corrupt_blocks == []
        assert not rep.sound
        dry = local_verify.verify(s.local, read_data=read_data, repair=True, dry_run=True)
        assert dry.plan is not None and dry.plan.drop == [lie.digest] and not dry.plan.quarantine
        rep = local_verify.verify(s.local, read_data=read_data, repair=True)
        assert rep.dropped_entries == [lie.digest.hex()] and rep.quarantined == []
        assert rep.cut_entries == []
        assert_nothing_good_lost(s, root, ids, blocks, good)


def test_local_verify_never_quarantines_a_good_block_a_manifest_misstates(
    tmp_path: Path,
) -> None:
    """``inspect`` hashes a block of another size before it calls it corrupt: a file whose
    bytes hash to its name is 'sized', and no repair moves it aside."""
    root = tmp_path / "root"
    with open_store(root) as s:
        good = _three(s)
        m = s.manifest(s.lookup(good[0]).entry_id)  # type: ignore[union-attr]
        b = bytes(m.token_blocks[0])
        size = s.local.blocks.stat(b).size  # type: ignore[union-attr]
        state, why, hashed = s.local.blocks.inspect(b, size // 2, read_data=False)
        assert (state, hashed) == ("sized", size) and "hashing to its name" in why
        rep = local_verify.verify(s.local, read_data=True, repair=True)
        assert rep.quarantined == [] and s.local.blocks.exists(b)
        # a file of another size whose bytes are wrong is still corrupt
        path = s.local.blocks.path(b)
        path.chmod(0o644)
        path.write_bytes(path.read_bytes()[: size // 2])
        state, why, _ = s.local.blocks.inspect(b, size, read_data=False)
        assert state == "corrupt" and why == f"{size // 2} bytes, not {size}"
