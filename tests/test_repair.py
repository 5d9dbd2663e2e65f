"""verify --repair keeps what is intact, --dry-run changes nothing (issue 12); verify and
repair work on roots holding non-trimmable entries (issue 17, item 1).

Only the public API, the command line and the root layout of docs/FORMAT.md (§1) are used.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache
from test_integrity import (
    block_file,
    damage,
    exact_refcounts,
    holds,
    make_cache,
    open_store,
    quarantined,
    toks,
)


def cli(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def tree(root: Path) -> dict[str, str]:
    """Every file and link of the root with a digest of its contents (lock.mdb aside)."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.name == "lock.mdb":
            continue
        if p.is_symlink():
            out[rel] = "-> " + str(p.readlink())
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def entries(root: Path) -> list[tuple[str, int]]:
    with open_store(root) as s:
        return sorted((e.id, e.n_tokens) for e in s.entries())


def spoil(root: Path, entry_id: str, index: int, how: str = "flip") -> bytes:
    with open_store(root) as s:
        blocks = [bytes(d) for d in s.manifest(entry_id).token_blocks]
    other = blocks[index - 1] if index else blocks[index + 1]
    damage(root, blocks[index], how, other, root.parent / "outside")
    return blocks[index]


# --- keeping the intact prefix ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["flip", "truncate", "swap"])
def test_repair_cuts_a_trimmable_entry_back_to_its_intact_blocks(tmp_path: Path, how: str) -> None:
    root = tmp_path / "root"
    long = toks(80)
    with open_store(root) as s:
        long_id = s.save(long, make_cache(long)).id
    bad = spoil(root, long_id, 3, how)
    with open_store(root) as s:
        r = s.verify(read_data=True, repair=True)
        assert r.corrupt_blocks == [bad.hex()] and r.quarantined == [bad.hex()]
        assert r.dropped_entries == []
        assert [(c["entry"], c["n_tokens"]) for c in r.plan.as_dict()["cut"]] == [(long_id, 48)]
        (entry,) = list(s.entries())
        assert entry.n_tokens == 48
        m = s.lookup(long)
        assert m is not None and m.length == 48 and m.entry_id == entry.id
        cache, n = s.restore(long, verify=True)
        assert n == 48 and holds(cache, long, 48)
        exact_refcounts(s)
        assert s.verify(read_data=True).clean
    assert quarantined(root, bad)


def test_repair_drops_an_entry_whose_intact_prefix_is_already_stored(tmp_path: Path) -> None:
    root = tmp_path / "root"
    long = toks(80)
    with open_store(root) as s:
        long_id = s.save(long, make_cache(long)).id
        short_id = s.save(long[:32], make_cache(long[:32])).id
    bad = spoil(root, long_id, 2)
    with open_store(root) as s:
        r = s.verify(read_data=True, repair=True)
        assert r.dropped_entries == [long_id] and r.plan.as_dict()["cut"] == []
        exact_refcounts(s)
    assert entries(root) == [(short_id, 32)] and quarantined(root, bad)


def test_one_bad_shared_block_no_longer_drops_the_blocks_before_it(tmp_path: Path) -> None:
    """The issue's case: a corrupt block every entry shares dropped every entry."""
    root = tmp_path / "root"
    base = toks(32)
    seqs = [base + toks(20 + 10 * i, 2 + i) for i in range(3)]
    with open_store(root) as s:
        for x in seqs:
            s.save(x, make_cache(x))
        first = next(iter(s.entries())).id
    spoil(root, first, 1)
    with open_store(root) as s:
        r = s.verify(read_data=True, repair=True)
        assert len(r.plan.as_dict()["cut"]) == 1 and len(r.dropped_entries) == 2
        assert [e.n_tokens for e in s.entries()] == [16]
        for x in seqs:
            cache, n = s.restore(x)
            assert n == 16 and holds(cache, x, 16)
        exact_refcounts(s)


def test_a_bad_first_block_drops_the_entry(tmp_path: Path) -> None:
    root = tmp_path / "root"
    long = toks(40)
    with open_store(root) as s:
        long_id = s.save(long, make_cache(long)).id
    spoil(root, long_id, 0)
    with open_store(root) as s:
        r = s.verify(read_data=True, repair=True)
        assert r.dropped_entries == [long_id] and r.plan.as_dict()["cut"] == []
        assert list(s.entries()) == [] and s.restore(long) == (None, 0)
        exact_refcounts(s)


# --- non-trimmable entries -----------------------------------------------------------------------


def ssm_cache() -> list[Any]:
    c = ArraysCache(2)
    c[0] = mx.random.normal((1, 3, 64), key=mx.random.key(1))
    c[1] = mx.random.normal((1, 2, 16, 16), key=mx.random.key(2))
    return [c]


def wrapped_ring(n: int) -> list[Any]:
    c = RotatingKVCache(max_size=64)
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(3)).astype(mx.float16)
    for i in range(n):
        c.update_and_fetch(k[:, :, i : i + 1], k[:, :, i : i + 1] + 1)
    return [c]


def state_block(root: Path, entry_id: str) -> bytes:
    """The first block of an entry that cannot be cut back: SSM state, or a window
    block of a wrapped ring (stored in token order since issue 26)."""
    with open_store(root) as s:
        m = s.manifest(entry_id)
        blocks = m.state_blocks or m.window_blocks
        assert blocks and not m.token_blocks
        return bytes(blocks[0])


@pytest.fixture
def mixed(tmp_path: Path) -> tuple[Path, dict[str, str], dict[str, list[int]]]:
    """A trimmable entry, an SSM-state entry and a wrapped ring (100 tokens, max 64)."""
    root = tmp_path / "root"
    t = {"kv": toks(50), "ssm": toks(30, 5), "ring": toks(100, 6)}
    with open_store(root) as s:
        ids = {
            "kv": s.save(t["kv"], make_cache(t["kv"])).id,
            "ssm": s.save(t["ssm"], ssm_cache()).id,
            "ring": s.save(t["ring"], wrapped_ring(100)).id,
        }
    return root, ids, t


def test_verify_and_repair_of_a_sound_root_with_non_trimmable_entries(
    mixed: tuple[Path, dict[str, str], dict[str, list[int]]]
) -> None:
    root, _, _ = mixed
    for args in (["verify"], ["verify", "--read-data"], ["verify", "--read-data", "--repair"]):
        p = cli(*args, "--root", root, cwd=root.parent)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr


@pytest.mark.parametrize("kind", ["ssm", "ring"])
def test_repair_drops_a_non_trimmable_entry_with_a_bad_block(
    mixed: tuple[Path, dict[str, str], dict[str, list[int]]], kind: str
) -> None:
    root, ids, t = mixed
    bad = state_block(root, ids[kind])
    damage(root, bad, "flip", b"", root.parent / "outside")
    with open_store(root) as s:
        r = s.verify(read_data=True, repair=True)
        assert r.corrupt_blocks == [bad.hex()] and r.dropped_entries == [ids[kind]]
        assert {e.id for e in s.entries()} == set(ids.values()) - {ids[kind]}
        assert s.restore(t[kind]) == (None, 0)
        exact_refcounts(s)
    assert quarantined(root, bad)


@pytest.mark.parametrize("kind", ["ssm", "ring"])
def test_default_restore_of_a_non_trimmable_entry_with_a_bad_block_is_a_miss(
    mixed: tuple[Path, dict[str, str], dict[str, list[int]]], kind: str
) -> None:
    root, ids, t = mixed
    bad = state_block(root, ids[kind])
    damage(root, bad, "flip", b"", root.parent / "outside")
    with open_store(root) as s:
        assert s.restore(t[kind]) == (None, 0)
        assert ids[kind] not in {e.id for e in s.entries()}
        exact_refcounts(s)
    assert quarantined(root, bad)


# --- the plan: --dry-run, and nothing to repair ---------------------------------------------------


def test_dry_run_changes_nothing_and_the_real_run_does_what_it_said(tmp_path: Path) -> None:
    root = tmp_path / "root"
    long, other = toks(80), toks(40, 3)
    with open_store(root) as s:
        long_id = s.save(long, make_cache(long)).id
        other_id = s.save(other, make_cache(other)).id
    bad_long = spoil(root, long_id, 3)
    bad_other = spoil(root, other_id, 0, "truncate")
    before = tree(root)
    p = cli("verify", "--read-data", "--repair", "--dry-run", "--root", root, cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    assert p.stdout.startswith("dry run: nothing was changed")
    for needle in (bad_long.hex()[:12], bad_other.hex()[:12], long_id[:12], other_id[:12],
                   "48 tokens"):
        assert needle in p.stdout, (needle, p.stdout)
    assert tree(root) == before
    dry = cli("verify", "--read-data", "--repair", "--dry-run", "--json", "--root", root,
              cwd=tmp_path)
    assert tree(root) == before
    planned = json.loads(dry.stdout)
    assert planned["dry_run"] is True
    assert sorted(planned["report"]["plan"]["quarantine"]) == sorted(
        [bad_long.hex(), bad_other.hex()])
    assert planned["report"]["plan"]["drop"] == [other_id]
    with open_store(root) as s:  # the API's dry run says the same and changes nothing either
        r = s.verify(read_data=True, repair=True, dry_run=True)
        assert r.plan.as_dict() == planned["report"]["plan"] and not r.repaired
    assert tree(root) == before
    real = cli("verify", "--read-data", "--repair", "--json", "--root", root, cwd=tmp_path)
    done = json.loads(real.stdout)
    assert done["report"]["plan"] == planned["report"]["plan"]
    assert done["report"]["repaired"] is True
    cut = planned["report"]["plan"]["cut"]
    assert [(c["entry"], c["n_tokens"]) for c in cut] == [(long_id, 48)]
    assert entries(root) == [(cut[0]["to"], 48)]
    with open_store(root) as s:
        exact_refcounts(s)


def test_repair_of_a_sound_store_says_nothing_needed_repair(tmp_path: Path) -> None:
    root = tmp_path / "root"
    long = toks(80)
    with open_store(root) as s:
        s.save(long, make_cache(long))
    before = tree(root)
    for extra in ([], ["--dry-run"]):
        p = cli("verify", "--read-data", "--repair", *extra, "--root", root, cwd=tmp_path)
        assert p.returncode == 0 and p.stderr == "", p
        assert "nothing needed repair" in p.stdout and "repaired" not in p.stdout, p.stdout
    assert tree(root) == before


def test_verify_without_read_data_says_block_contents_were_not_read(tmp_path: Path) -> None:
    root = tmp_path / "root"
    long = toks(40)
    with open_store(root) as s:
        s.save(long, make_cache(long))
    p = cli("verify", "--root", root, cwd=tmp_path)
    assert p.returncode == 0
    assert "block contents were not read" in p.stdout and "--read-data" in p.stdout
    p = cli("verify", "--read-data", "--root", root, cwd=tmp_path)
    assert p.returncode == 0 and "not read" not in p.stdout


def test_dry_run_without_repair_is_a_usage_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with open_store(root):
        pass
    p = cli("verify", "--dry-run", "--root", root, cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_block_file_helper_names_the_layout(tmp_path: Path) -> None:
    """The tests above find blocks at blocks/ab/<hex>, the layout docs/FORMAT.md fixes."""
    root = tmp_path / "root"
    long = toks(20)
    with open_store(root) as s:
        m = s.manifest(s.save(long, make_cache(long)).id)
    assert all(block_file(root, bytes(d)).is_file() for d in m.token_blocks)
