"""Hostile and unlucky roots (issue 17): symlinked directories, racing inits, a deleted
lock file, read-only filesystems.

Every hostile root is built here in ``tmp_path``; a test that could reach a
directory outside its root checks that directory's contents before and after.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.kv import NS, T, make_cache, matches, open_store, run_worker, tokens_for

import kvstore
from kvstore.errors import KVStoreError, ReadOnlyStoreError, RootSettingsError

TESTS = Path(__file__).resolve().parent
OLD = time.time() - 30 * 24 * 3600  # a month old: any grace period has passed


def tree(d: Path) -> dict[str, tuple[str, int, int]]:
    """Everything under ``d`` (not following symlinks): kind, size, mtime."""
    out: dict[str, tuple[str, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(d, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            kind = "link" if p.is_symlink() else "dir" if p.is_dir() else "file"
            out[str(p.relative_to(d))] = (kind, st.st_size, st.st_mtime_ns if kind != "dir" else 0)
    return out


def decoys(d: Path, names: list[str]) -> Path:
    """A directory outside any root holding old regular files (what a sweep would delete)."""
    d.mkdir(parents=True, exist_ok=True)
    for name in names:
        f = d / name
        f.write_bytes(b"precious " + name.encode())
        os.utime(f, (OLD, OLD))
    return d


def saved_root(path: Path, n_entries: int = 2) -> list[list[int]]:
    toks = [tokens_for(seed, 40) for seed in range(n_entries)]
    with open_store(path) as s:
        for t in toks:
            s.save(t, make_cache(t))
    return toks


def cli(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("KVSTORE_ROOT", None)
    return subprocess.run([sys.executable, "-m", "kvstore", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


# --- item 2: the root's own directories are real directories; walks never follow links ----


@pytest.mark.parametrize("sub", ["tmp", "quarantine", "blocks", "index"])
def test_a_symlinked_root_directory_is_refused_at_open(tmp_path: Path, sub: str) -> None:
    root = tmp_path / "root"
    saved_root(root)
    outside = tmp_path / "outside"
    target = outside / sub
    if (root / sub).exists():
        shutil.move(root / sub, target)  # its real contents, now outside the root
    decoys(target, ["old-1.tmp", "notes.txt"])
    (root / sub).symlink_to(target, target_is_directory=True)
    before = tree(outside)
    with pytest.raises(KVStoreError, match=f"{sub}.*symlink|symlink.*{sub}"):
        open_store(root)
    assert tree(outside) == before


def test_compact_never_deletes_through_a_symlinked_tmp(tmp_path: Path) -> None:
    root = tmp_path / "root"
    saved_root(root)
    outside = decoys(tmp_path / "outside", ["1-0-aaaa.tmp", "photo.jpg", "report.pdf"])
    shutil.rmtree(root / "tmp")
    (root / "tmp").symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    r = cli("compact", "--grace", "0", "--root", root)
    assert r.returncode == 2, r
    assert "symlink" in r.stderr and "tmp" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert tree(outside) == before


def test_repair_never_moves_blocks_through_a_symlinked_quarantine(tmp_path: Path) -> None:
    root = tmp_path / "root"
    saved_root(root)
    blocks = sorted(p for p in (root / "blocks").rglob("*") if p.is_file())
    victim = blocks[0]
    victim.write_bytes(b"\xff" * victim.stat().st_size)  # corrupt, same size
    outside = decoys(tmp_path / "outside", ["keep.txt"])
    (root / "quarantine").symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    r = cli("verify", "--read-data", "--repair", "--root", root)
    assert r.returncode == 2, r
    assert "symlink" in r.stderr and "quarantine" in r.stderr, r.stderr
    assert tree(outside) == before
    assert victim.is_file()  # nothing was moved anywhere


def _fake_fanout(root: Path, outside: Path) -> tuple[Path, str]:
    """A fan-out directory of the root that is a symlink to ``outside``, holding a file
    named like a block (no refs record, old: an orphan sweep would delete it)."""
    used = {p.name for p in (root / "blocks").iterdir()}
    fan = next(f"{i:02x}" for i in range(256) if f"{i:02x}" not in used)
    name = fan + "0" * 62
    decoys(outside, [name])
    (root / "blocks" / fan).symlink_to(outside, target_is_directory=True)
    return root / "blocks" / fan, name


def test_a_symlinked_fanout_directory_is_refused_at_open(tmp_path: Path) -> None:
    root = tmp_path / "root"
    saved_root(root)
    outside = tmp_path / "outside"
    link, _ = _fake_fanout(root, outside)
    before = tree(outside)
    with pytest.raises(KVStoreError, match="symlink"):
        open_store(root)
    assert tree(outside) == before


def test_sweeps_never_follow_a_fanout_symlink_made_after_open(tmp_path: Path) -> None:
    root = tmp_path / "root"
    toks = saved_root(root)
    outside = tmp_path / "outside"
    with open_store(root) as s:
        _fake_fanout(root, outside)
        before = tree(outside)
        s.compact(grace=0)
        assert tree(outside) == before
        r = s.verify(repair=True)
        assert tree(outside) == before
        assert not r.dropped_entries
        for t in toks:
            cache, n = s.restore(t)
            assert cache is not None and matches(cache, t, n)


def test_the_tmp_sweep_refuses_a_tmp_swapped_for_a_symlink_after_open(tmp_path: Path) -> None:
    root = tmp_path / "root"
    saved_root(root)
    outside = decoys(tmp_path / "outside", ["1-0-aaaa.tmp", "old.log"])
    before = tree(outside)
    with open_store(root) as s:
        shutil.rmtree(root / "tmp")
        (root / "tmp").symlink_to(outside, target_is_directory=True)
        with pytest.raises(KVStoreError, match="symlink"):
            s.compact(grace=0)
    assert tree(outside) == before


def test_a_symlinked_root_itself_is_fine(tmp_path: Path) -> None:
    """A root reached through a symlink (``~/.cache/kvstore -> /data/kvstore``) is normal."""
    real = tmp_path / "real"
    toks = saved_root(real)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with open_store(link) as s:
        cache, n = s.restore(toks[0])
        assert cache is not None and matches(cache, toks[0], n)
        s.compact(grace=0)
        assert s.verify(read_data=True).sound


# --- item 6: creating a root is atomic --------------------------------------------------

_INIT_RACE = textwrap.dedent(
    """
    import json, sys, time
    import kvstore
    from kvstore.errors import RootSettingsError
    roots, starts, block_tokens = json.loads(sys.argv[1])
    out = []
    for root, start in zip(roots, starts):
        time.sleep(max(0.0, start - time.time() - 0.002))
        while time.time() < start:
            pass
        try:
            s = kvstore.Store.open(root, block_tokens=block_tokens, durable=False)
        except RootSettingsError:
            out.append(None)
            continue
        out.append(s.local.settings.block_tokens)
        s.close()
    print(json.dumps(out))
    """
)


def test_two_racing_opens_of_a_new_root_exactly_one_wins(tmp_path: Path) -> None:
    trials = 60
    roots = [str(tmp_path / f"r{i}") for i in range(trials)]
    warmup = 4.0  # both interpreters import kvstore first
    t0 = time.time() + warmup
    starts = [t0 + 0.05 * i for i in range(trials)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _INIT_RACE, json.dumps([roots, starts, bt])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for bt in (16, 32)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    both = 0
    for i, (a, b) in enumerate(zip(*outs, strict=True)):
        with kvstore.Store.open(roots[i], create=False) as s:
            stored = s.local.settings.block_tokens
        if a is not None and b is not None:
            both += 1
        else:
            assert (a, b) in ((16, None), (None, 32)), (i, a, b)
            assert stored == (a or b), (i, a, b, stored)
    assert both == 0, f"{both} of {trials} races let both opens succeed"


def test_two_threads_creating_one_root_exactly_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race made certain: the settings' timestamp takes 0.3 s, so both opens find
    no settings before either has written its own."""
    import threading

    import kvstore.local.root as root_mod

    real = root_mod.now_ms

    def slow_now() -> int:
        time.sleep(0.3)
        return int(real())

    monkeypatch.setattr(root_mod, "now_ms", slow_now)
    got: dict[int, int | None] = {}

    def open_with(bt: int) -> None:
        try:
            s = kvstore.Store.open(tmp_path / "r", block_tokens=bt, durable=False)
        except RootSettingsError:
            got[bt] = None
            return
        got[bt] = s.local.settings.block_tokens
        s.close()

    threads = [threading.Thread(target=open_with, args=(bt,), daemon=True) for bt in (16, 32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(got) == [16, 32]
    winners = [bt for bt, v in got.items() if v is not None]
    assert len(winners) == 1, got
    assert got[winners[0]] == winners[0]
    monkeypatch.undo()
    with kvstore.Store.open(tmp_path / "r", create=False) as s:
        assert s.local.settings.block_tokens == winners[0]


def test_an_existing_root_keeps_its_settings_through_the_cli(tmp_path: Path) -> None:
    root = tmp_path / "r"
    assert cli("init", "--block-tokens", "16", "--root", root).returncode == 0
    r = cli("init", "--block-tokens", "32", "--root", root)
    assert r.returncode == 2 and "block_tokens=16" in r.stderr, r
    with pytest.raises(RootSettingsError):
        kvstore.Store.open(root, block_tokens=32)


# --- item 7: a deleted lock file is detected, never written through -------------------

_LOCK_WRITER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from helpers.kv import make_cache, open_store, tokens_for
    root = sys.argv[1]
    s = open_store(root)
    t = tokens_for(1, 40)
    s.save(t, make_cache(t))
    print("ready", flush=True)
    sys.stdin.readline()
    t = tokens_for(2, 40)
    try:
        s.save(t, make_cache(t))
        print(json.dumps({"saved": True}))
    except Exception as e:
        import kvstore.errors as E
        print(json.dumps({"saved": False, "error": type(e).__name__, "message": str(e),
                          "typed": isinstance(e, E.KVStoreError)}))
    """
)


def test_a_deleted_lock_file_stops_old_writers_instead_of_corrupting(tmp_path: Path) -> None:
    root = tmp_path / "r"
    open_store(root).close()
    a = subprocess.Popen([sys.executable, "-c", _LOCK_WRITER, str(root), str(TESTS)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert a.stdout is not None and a.stdin is not None
        assert a.stdout.readline().strip() == "ready"
        (root / "index" / "lock.mdb").unlink()  # what must never be done by hand
        code, res, err = run_worker("save", {"root": str(root), "seed": 3, "n": 40})
        assert code == 0, err  # a new process makes a new lock file and writes
        a.stdin.write("go\n")
        a.stdin.flush()
        out, err = a.communicate(timeout=60)
    finally:
        if a.poll() is None:
            a.kill()
    assert a.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["saved"] is False and res["typed"], res
    assert "lock.mdb" in res["message"], res
    with open_store(root) as s:
        for seed, present in ((1, True), (2, False), (3, True)):
            t = tokens_for(seed, 40)
            cache, n = s.restore(t)
            assert (cache is not None) == present, seed
            if cache is not None:
                assert matches(cache, t, n)
        assert s.verify(read_data=True).sound


def test_a_deleted_lock_file_is_a_typed_error_at_the_next_write(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with open_store(root) as s:
        t = tokens_for(1, 40)
        s.save(t, make_cache(t))
        (root / "index" / "lock.mdb").unlink()
        t2 = tokens_for(2, 40)
        with pytest.raises(KVStoreError, match="lock.mdb"):
            s.save(t2, make_cache(t2))
        blocks_before = tree(root / "blocks")
        with pytest.raises(KVStoreError, match="lock.mdb"):
            s.delete(s.lookup(t).entry_id)  # type: ignore[union-attr]
        assert s.lookup(t) is not None  # reads still answer
        assert tree(root / "blocks") == blocks_before


def test_format_docs_say_what_must_never_be_deleted() -> None:
    text = (TESTS.parent / "docs" / "FORMAT.md").read_text(encoding="utf-8")
    never = text.index("Never delete or replace by hand")
    assert "`index/lock.mdb`" in text[never : never + 400]
    assert "IndexLockLostError" in text


# --- item 12: read-only roots ---------------------------------------------------------


@pytest.fixture
def ro_mount(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs that the test fills and then remounts read-only (needs root)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip(reason="requires the mount command (root, to mount a tmpfs)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(reason=f"requires mounting a tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount_ro(mnt: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with pytest.raises(OSError):
        (mnt / "probe").write_bytes(b"")


def test_a_root_on_a_read_only_filesystem_is_opened_read_only(ro_mount: Path) -> None:
    root = ro_mount / "r"
    toks = saved_root(root, 3)
    _remount_ro(ro_mount)
    before = tree(root)
    with open_store(root) as s:
        assert s.read_only
        st = s.stats()
        assert st.entries == 3
        assert len(list(s.entries())) == 3
        for t in toks:
            assert s.lookup(t) is not None
            cache, n = s.restore(t, verify=True)
            assert cache is not None and matches(cache, t, n)
        assert s.verify(read_data=True).sound
        t = tokens_for(99, 40)
        with pytest.raises(ReadOnlyStoreError):
            s.save(t, make_cache(t))
        eid = s.lookup(toks[0]).entry_id  # type: ignore[union-attr]
        with pytest.raises(ReadOnlyStoreError):
            s.delete(eid)
        with pytest.raises(ReadOnlyStoreError):
            s.compact(grace=0)
        with pytest.raises(ReadOnlyStoreError):
            s.verify(repair=True)
    assert tree(root) == before


def test_the_cli_reads_a_read_only_root_and_refuses_writes(ro_mount: Path) -> None:
    root = ro_mount / "r"
    toks = saved_root(root, 2)
    with open_store(root) as s:
        eid = s.lookup(toks[0]).entry_id  # type: ignore[union-attr]
    _remount_ro(ro_mount)
    for args in (("stats",), ("ls",), ("tree",), ("show", eid[:8]), ("verify",)):
        r = cli(*args, "--root", root)
        assert r.returncode == 0, (args, r)
        notices = [ln for ln in r.stderr.splitlines() if "read-only" in ln]
        assert len(notices) == 1, (args, r.stderr)
        assert "Traceback" not in r.stderr
    for args in (("rm", eid[:8]), ("compact", "--grace", "0")):
        r = cli(*args, "--root", root)
        assert r.returncode == 2, (args, r)
        assert "kvstore: error:" in r.stderr and "read-only" in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_a_write_refused_on_a_read_only_root_is_one_line(ro_mount: Path, tmp_path: Path) -> None:
    """Issue 27, item 11: CLI.md promises one line for a user error; the read-only notice
    the reading commands print is folded into it."""
    root = ro_mount / "r"
    toks = saved_root(root, 2)
    with open_store(root) as s:
        eid = s.lookup(toks[0]).entry_id  # type: ignore[union-attr]
    f = tmp_path / "a.kv"
    assert cli("export", eid[:8], f, "--root", root).returncode == 0
    _remount_ro(ro_mount)
    for args, what in ((("rm", eid[:8]), "remove entries"), (("compact",), "compact"),
                       (("verify", "--repair"), "repair"), (("import", f), "import")):
        r = cli(*args, "--root", root)
        assert r.returncode == 2 and r.stdout == "", (args, r)
        assert r.stderr.splitlines() == [
            f"kvstore: error: {root} is read-only here (a read-only filesystem, or another "
            f"user's root): cannot {what}"], (args, r.stderr)
    assert cli("compact", "--dry-run", "--root", root).returncode == 0


def test_read_only_true_changes_nothing_on_a_writable_root(tmp_path: Path) -> None:
    root = tmp_path / "r"
    toks = saved_root(root, 2)

    def snapshot() -> dict[str, Any]:
        return {k: v for k, v in tree(root).items() if k != os.path.join("index", "lock.mdb")}

    before = snapshot()
    with kvstore.Store.open(root, namespace=NS, read_only=True) as s:
        assert s.read_only and s.local.settings.block_tokens == T
        cache, n = s.restore(toks[0])
        assert cache is not None and matches(cache, toks[0], n)
        t = tokens_for(50, 40)
        with pytest.raises(ReadOnlyStoreError):
            s.save(t, make_cache(t))
        with pytest.raises(ReadOnlyStoreError):
            s.import_file(TESTS / "data" / "mlx-bun-v3" / "kv-plain.kv")
    assert snapshot() == before
    with pytest.raises(kvstore.NotAStoreError):
        kvstore.Store.open(tmp_path / "absent", read_only=True)
    assert not (tmp_path / "absent").exists()
