"""A root's repair is a plan (issue 35, item 1): ``plan_repair`` reads it from one snapshot,
``report()`` says what ``execute()`` does, ``execute()`` runs once and skips what others
did meanwhile (an entry removed, a block written again whole)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_integrity import block_file, exact_refcounts, make_cache, open_store, quarantined, toks
from test_repair import entries, spoil, tree

from kvstore.local.verify import plan_repair


def _two(root: Path) -> tuple[str, str, bytes, bytes]:
    """A root whose long entry can be cut back (its block 3 spoiled) and whose other entry
    must be dropped (its first block spoiled)."""
    long, other = toks(80), toks(40, 3)
    with open_store(root) as s:
        long_id = s.save(long, make_cache(long)).id
        other_id = s.save(other, make_cache(other)).id
    return long_id, other_id, spoil(root, long_id, 3), spoil(root, other_id, 0, "truncate")


def test_the_report_is_what_execute_does(tmp_path: Path) -> None:
    root = tmp_path / "root"
    long_id, other_id, bad_long, bad_other = _two(root)
    before = tree(root)
    with open_store(root) as s:
        plan = plan_repair(s.local, read_data=True)
        said = plan.report().as_dict()
        assert tree(root) == before  # planning and reporting change nothing
        assert said["quarantine"] == sorted([bad_long.hex(), bad_other.hex()])
        assert said["drop"] == [other_id]
        assert [(c["entry"], c["n_tokens"]) for c in said["cut"]] == [(long_id, 48)]
        done = plan.execute()
        assert done.as_dict() == said
        assert plan.report().as_dict() == said  # the plan still says what it was
        exact_refcounts(s)
    assert entries(root) == [(said["cut"][0]["to"], 48)]
    assert quarantined(root, bad_long) and quarantined(root, bad_other)


def test_a_plan_is_executed_once(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _two(root)
    with open_store(root) as s:
        plan = plan_repair(s.local, read_data=True)
        plan.execute()
        after = tree(root)
        with pytest.raises(RuntimeError, match="a plan is executed once: make a new plan"):
            plan.execute()
        assert tree(root) == after
        again = plan_repair(s.local, read_data=True)  # a new plan: nothing left to do
        assert again.report().empty() and again.execute().empty()
    assert tree(root) == after


def test_a_plan_skips_what_others_removed_meanwhile(tmp_path: Path) -> None:
    root = tmp_path / "root"
    long_id, other_id, bad_long, bad_other = _two(root)
    with open_store(root) as s:
        plan = plan_repair(s.local, read_data=True)
        assert plan.report().drop == [bytes.fromhex(other_id)]
        with open_store(root) as t:  # another process deletes the entry the plan drops
            assert t.delete(other_id)
        done = plan.execute()
        assert done.drop == [] and other_id not in done.as_dict()["drop"]
        assert [c.entry.hex() for c in done.cut] == [long_id]
        assert sorted(done.quarantine) == sorted([bad_long, bad_other])  # still corrupt
        exact_refcounts(s)


def test_a_plan_leaves_a_block_written_again_whole_meanwhile(tmp_path: Path) -> None:
    root = tmp_path / "root"
    long = toks(80)
    with open_store(root) as s:
        long_id = s.save(long, make_cache(long)).id
    with open_store(root) as s:
        blocks = [bytes(d) for d in s.manifest(long_id).token_blocks]
    good = tmp_path / "good"
    shutil.copyfile(block_file(root, blocks[3]), good)
    bad = spoil(root, long_id, 3)
    with open_store(root) as s:
        plan = plan_repair(s.local, read_data=True)
        assert list(plan.report().quarantine) == [bad] and len(plan.report().cut) == 1
        block_file(root, bad).unlink()
        shutil.copyfile(good, block_file(root, bad))  # a save wrote it again meanwhile
        done = plan.execute()
        assert done.quarantine == {} and done.cut == [] and done.drop == []
        assert not quarantined(root, bad)
        exact_refcounts(s)
    assert entries(root) == [(long_id, 80)]
