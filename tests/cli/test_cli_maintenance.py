"""init, rm, compact and verify: commands that change a root."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_helpers import Root, assert_user_error, run, run_here

from kvstore import Store


def test_init_creates_a_root_with_chosen_settings(tmp_path: Path) -> None:
    root = tmp_path / "new"
    r = run("init", "--root", root, "--hash", "sha256", "--block-tokens", "32")
    assert r.code == 0 and r.err == ""
    assert r.out == f"Created kvstore root at {root} (sha256, 32 tokens per block)\n"
    with Store.open(root, create=False) as s:
        assert (s.local.settings.hash, s.local.settings.block_tokens) == ("sha256", 32)
    again = run_here("init", "--root", root, "--json").json()
    assert again == {"root": str(root), "created": False, "hash": "sha256", "block_tokens": 32,
                     "state_block_bytes": 4 << 20, "shared_group": None}
    assert run_here("init", "--root", root, "--hash", "sha256").code == 0
    assert_user_error(run_here("init", "--root", root, "--block-tokens", "64"),
                      "block_tokens=32", "64")


def test_init_uses_kvstore_root_from_the_environment(tmp_path: Path) -> None:
    root = tmp_path / "from-env"
    r = run("init", "--json", env={"KVSTORE_ROOT": str(root)})
    assert r.code == 0 and r.json()["created"] is True and r.json()["root"] == str(root)
    assert run("--root", root, "stats", "--json").json()["entries"] == 0


def test_init_refuses_a_directory_that_is_not_a_root(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert_user_error(run_here("init", "--root", tmp_path), "not a kvstore root")
    assert_user_error(run_here("init", "--root", tmp_path, "--block-tokens", "0"),
                      "--block-tokens")
    assert_user_error(run_here("init", "--root", tmp_path, "--hash", "md5"), "--hash")


def test_rm_removes_entries_and_reports_unreferenced_bytes(fresh_root: Root) -> None:
    ids = fresh_root.ids
    r = run("rm", ids["a40"][:10], ids["g20"], "--root", fresh_root.path)
    assert r.code == 0 and r.err == ""
    lines = r.out.splitlines()
    assert lines[0] == f"removed {ids['a40'][:12]} (40 tokens, 1.0 KiB unique)"
    assert lines[1] == f"removed {ids['g20'][:12]} (20 tokens, 1.2 KiB unique)"
    assert "2.2 KiB of blocks are now unreferenced" in lines[2] and "kvstore compact" in lines[2]
    left = {e["id"] for e in run_here("ls", "--root", fresh_root.path, "--json").json()["entries"]}
    assert left == {ids[k] for k in ("a64", "a70", "a90", "o48")}
    d = run("rm", ids["a70"], "--root", fresh_root.path, "--json").json()
    assert d["removed"] == [{"id": ids["a70"], "n_tokens": 70, "unique_bytes": 6 * 128}]
    assert d["unreferenced_bytes"] == 6 * 128
    assert run_here("rm", "-q", ids["a64"], "--root", fresh_root.path).out == ""


def test_rm_checks_every_id_before_removing_any(fresh_root: Root) -> None:
    r = run("rm", fresh_root.ids["a40"], "beefbeef", "--root", fresh_root.path)
    assert_user_error(r, "beefbeef")
    assert len(run_here("ls", "--root", fresh_root.path, "--json").json()["entries"]) == 6
    assert_user_error(run_here("rm", "--root", fresh_root.path), "ENTRY")


def test_compact_dry_run_then_budget(fresh_root: Root) -> None:
    root = fresh_root.path
    run_here("rm", fresh_root.ids["a90"], "--root", root)
    r = run("compact", "--dry-run", "--grace", "0", "--root", root)
    assert r.code == 0 and r.err == ""
    assert r.out.startswith("dry run: nothing was changed")
    assert "would sweep 2 unreferenced blocks (3.2 KiB)" in r.out
    assert run_here("stats", "--root", root, "--json").json()["unreferenced_blocks"] == 2
    d = run("compact", "--grace", "0", "--json", "--root", root).json()
    assert d["dry_run"] is False and d["report"]["freed_blocks"] == 2
    assert d["report"]["freed_bytes"] == 2 * 16 * 128 - 6 * 128
    assert run_here("stats", "--root", root, "--json").json()["unreferenced_blocks"] == 0
    budget = run("compact", "--max-bytes", "6KiB", "--grace", "0", "--json", "--root", root)
    report = budget.json()["report"]
    assert report["evicted"] and report["physical_after"] <= 6 * 1024
    assert run_here("verify", "--root", root).code == 0


def test_compact_bad_budget_is_a_user_error(fresh_root: Root) -> None:
    r = run("compact", "--max-bytes", "ten gigs", "--root", fresh_root.path)
    assert_user_error(r, "--max-bytes", "ten gigs", "10G")
    assert_user_error(run_here("compact", "--namespace-max-bytes", "5X", "--root",
                               fresh_root.path), "--namespace-max-bytes")
    assert_user_error(run_here("compact", "--grace", "-1", "--root", fresh_root.path), "--grace")


def test_verify_sound_then_corrupt_exits_1(fresh_root: Root) -> None:
    root = fresh_root.path
    r = run("verify", "--read-data", "--root", root)
    assert r.code == 0 and r.err == ""
    assert r.out.startswith("ok: the store is sound (checked 6 entries, ")
    ok = run_here("verify", "--json", "--root", root).json()
    assert ok["sound"] is True and ok["report"]["entries"] == 6
    with Store.open(root, create=False) as s:
        digest = s.manifest(fresh_root.ids["a40"]).token_blocks[-1]
        path = s.local.blocks.path(digest)
    path.write_bytes(b"\0" * path.stat().st_size)  # same size, wrong bytes
    bad = run("verify", "--read-data", "--root", root)
    assert bad.code == 1
    assert "corrupt blocks" in bad.out and digest.hex()[:12] in bad.out
    assert bad.err.strip() == (f"kvstore: verify found problems in {root}; "
                               f"'kvstore verify --read-data --repair --root {root}' can fix it")
    d = run("verify", "--read-data", "--json", "--root", root)
    assert d.code == 1 and d.json()["sound"] is False
    assert d.json()["report"]["corrupt_blocks"] == [digest.hex()]
    fixed = run_here("verify", "--read-data", "--repair", "--json", "--root", root).json()
    assert fixed["report"]["quarantined"] == [digest.hex()]
    assert run_here("verify", "--read-data", "--root", root).code == 0
    assert fresh_root.ids["a40"] not in run_here("ls", "--json", "--root", root).out


@pytest.mark.parametrize("damage", ["flipped byte", "missing file"])
def test_the_command_verify_suggests_is_the_one_that_fixes_it(fresh_root: Root,
                                                                damage: str) -> None:
    """Issue 27, item 5: verify --read-data finds a flipped byte that verify --repair alone
    cannot see; the hint names the command that repairs what was found, and running it
    leaves a sound store."""
    root = fresh_root.path
    with Store.open(root, create=False) as s:
        digest = s.manifest(fresh_root.ids["a40"]).token_blocks[-1]
        path = s.local.blocks.path(digest)
    if damage == "missing file":
        path.unlink()
        found = run_here("verify", "--root", root)
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        found = run_here("verify", "--read-data", "--root", root)
    assert found.code == 1
    hint = re.fullmatch(rf"kvstore: verify found problems in {re.escape(str(root))}; "
                        r"'kvstore (verify[^']*)' can fix it", found.err.strip())
    assert hint is not None, found.err
    fix = run_here(*hint.group(1).split(), "--root", root)  # exit 1: it found the problem
    assert "repair did this:" in fix.out and "nothing needed repair" not in fix.out, fix
    assert run_here("verify", "--read-data", "--root", root).code == 0



def test_a_repair_that_leaves_a_sound_store_exits_0_and_says_what_it_did(
        fresh_root: Root) -> None:
    """Issue 38, item 8: ``verify --read-data --repair`` exited 1 and said "verify found
    problems" after a repair that had left the store sound."""
    root = fresh_root.path
    with Store.open(root, create=False) as s:
        digest = s.manifest(fresh_root.ids["a40"]).token_blocks[-1]
        path = s.local.blocks.path(digest)
    path.write_bytes(b"\0" * path.stat().st_size)
    r = run("verify", "--read-data", "--repair", "--root", root)
    assert (r.code, r.err) == (0, ""), r
    lines = r.out.splitlines()
    at = lines.index("repair did this:")
    assert lines[at + 1].startswith(f"  quarantine block {digest.hex()} (bytes hashing to ")
    assert "verify found problems" not in r.out + r.err
    assert re.fullmatch(r"ok: the repair left the store sound \(checked again: 6 entries, "
                        r"\d+ blocks\)", lines[-1]), lines[-1]
    again = run_here("verify", "--read-data", "--repair", "--json", "--root", root)
    assert again.code == 0 and again.json()["sound"] is True
    assert again.json()["sound_after_repair"] is None  # nothing was found: nothing re-checked


def test_a_repair_json_says_the_store_was_unsound_and_the_repair_left_it_sound(
        fresh_root: Root) -> None:
    root = fresh_root.path
    with Store.open(root, create=False) as s:
        path = s.local.blocks.path(s.manifest(fresh_root.ids["a40"]).token_blocks[-1])
    path.unlink()
    r = run("verify", "--repair", "--json", "--root", root)
    assert (r.code, r.err) == (0, ""), r
    assert (r.json()["sound"], r.json()["sound_after_repair"]) == (False, True)
    assert r.json()["report"]["repaired"] is True
