"""Errors: one ``kvstore: error:`` line and exit 2; ``--debug`` adds the traceback."""

from __future__ import annotations

from pathlib import Path

from cli_helpers import Root, assert_user_error, run, run_here


def test_a_non_kvstore_directory_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "photo.jpg").write_bytes(b"\xff\xd8")
    r = run("ls", "--root", tmp_path)
    assert_user_error(r, str(tmp_path), "not a kvstore root")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photo.jpg"]


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    r = run("--debug", "stats", "--root", tmp_path / "missing")
    assert r.code == 2
    assert "Traceback (most recent call last)" in r.err and "NotAStoreError" in r.err
    assert r.err.rstrip().splitlines()[-1].startswith("kvstore: error: ")
    after = run_here("stats", "--debug", "--root", tmp_path / "missing")  # after the command too
    assert after.code == 2 and "Traceback" in after.err


def test_the_root_defaults_to_kvstore_root(shared_root: Root) -> None:
    r = run("ls", "--json", env={"KVSTORE_ROOT": str(shared_root.path)})
    assert r.code == 0 and r.json()["root"] == str(shared_root.path)
    assert len(r.json()["entries"]) == len(shared_root.ids)


def test_root_given_before_the_command_works_too(shared_root: Root) -> None:
    r = run_here("--root", shared_root.path, "stats", "--json")
    assert r.code == 0 and r.json()["entries"] == len(shared_root.ids)


def test_usage_errors_name_the_command(shared_root: Root) -> None:
    assert_user_error(run_here("show", "--root", shared_root.path), "ENTRY",
                      "kvstore show --help")
    assert_user_error(run_here("ls", "--bogus", "--root", shared_root.path), "--bogus")
