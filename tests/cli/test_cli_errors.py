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


# --- issue 38, item 10: hints carry the --root given; a file given as the root ------------------


def test_a_file_given_as_the_root_is_said_to_be_a_file(tmp_path: Path) -> None:
    """``--root FILE stats`` said "run kvstore init", and init then "is not a directory"."""
    f = tmp_path / "FILE"
    f.write_text("x\n")
    for args in (("stats",), ("init",), ("ls",)):
        r = run("--root", f, *args)
        assert (r.code, r.out, r.err) == (2, "", f"kvstore: error: {f} is a file, not a "
                                                 "directory: a kvstore root is a directory\n")
    assert f.read_text() == "x\n"


def test_the_init_hint_names_the_root_given_and_works(tmp_path: Path) -> None:
    root = tmp_path / "my-root"
    r = run("--root", root, "stats")
    assert (r.code, r.err) == (2, f"kvstore: error: {root} is not a kvstore root (no index/); "
                                  f"run 'kvstore init --root {root}'\n")
    r = run("stats", env={"KVSTORE_ROOT": str(root)})  # the environment's root: init finds it
    assert r.err == (f"kvstore: error: {root} is not a kvstore root (no index/); "
                     "run 'kvstore init'\n")
    assert run("init", "--root", root).code == 0
    assert run_here("--root", root, "stats").code == 0


def test_the_shared_group_hint_names_the_root(tmp_path: Path) -> None:
    """It printed a literal ``ROOT``."""
    import os

    from kvstore.local.modes import group_name

    root = tmp_path / "private"
    assert run("init", "--root", root).code == 0
    g = group_name(os.getgid())
    r = run("init", "--root", root, "--shared-group", g)
    assert (r.code, r.out) == (2, "")
    assert r.err == (
        f"kvstore: error: {root} is a private root (created before --shared-group, or without "
        f"it); kvstore never changes an existing root's modes. To share it with {g}, as its "
        f"owner: chgrp -R {g} {root} && chmod -R g+rwX,o-rwx {root} && "
        f"find {root} -type d -exec chmod g+s {{}} +\n")
