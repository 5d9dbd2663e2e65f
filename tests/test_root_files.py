"""What kvstore opens or chmods in a root is the root's own (issue 36, item 4): a link, a
FIFO or a file of a user the root does not trust, put where ``index/data.mdb`` or
``index/lock.mdb`` belongs, is refused before LMDB opens it (LMDB opens both by name,
following links) and never chmodded; the file a link points at is left as it was.

These run as any user (a shared root of the user's own group); the same attack between
two real OS users of a group is in tests/test_modes.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.kv import make_cache, open_store, tokens_for

from kvstore.errors import UnsafeRootError
from kvstore.index import IndexBusyError

LINK_WHY = ("is a symlink; a root's files must be regular files inside it (kvstore never "
            "opens or changes what a link in a root points to): remove the link (for "
            "data.mdb, put the root's own index back)")


def _root(path: Path, shared: bool) -> Path:
    toks = tokens_for(1, 40)
    kw = {"shared_group": os.getgid()} if shared else {}
    with open_store(path, **kw) as s:
        s.save(toks, make_cache(toks))
    return path


def _victim(tmp_path: Path) -> tuple[Path, bytes]:
    """Another root's private index: what a member would point a link at."""
    other = _root(tmp_path / "private", shared=False)
    f = other / "index" / "data.mdb"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    return f, f.read_bytes()


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
def test_an_index_file_replaced_by_a_link_is_refused_and_its_target_untouched(
        tmp_path: Path, name: str, shared: bool) -> None:
    root = _root(tmp_path / "root", shared)
    target, before = _victim(tmp_path)
    f = root / "index" / name
    f.unlink()
    f.symlink_to(target)
    with pytest.raises(UnsafeRootError) as e:
        open_store(root, create=False)
    assert str(e.value) == f"{f} {LINK_WHY}"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.read_bytes() == before
    # the command line: one line, exit 2, and still nothing changed
    p = subprocess.run([sys.executable, "-m", "kvstore", "--root", str(root), "ls"],
                       capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout, p.stderr) == (2, "", f"kvstore: error: {f} {LINK_WHY}\n")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.read_bytes() == before


def test_a_fifo_for_the_lock_file_is_refused_before_lmdb_opens_it(tmp_path: Path) -> None:
    root = _root(tmp_path / "root", shared=True)
    f = root / "index" / "lock.mdb"
    f.unlink()
    os.mkfifo(f, 0o660)
    with pytest.raises(UnsafeRootError) as e:
        open_store(root, create=False)
    assert str(e.value) == f"{f} is a FIFO, not a regular file; kvstore refuses to open it"


_as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@_as_root
def test_an_index_file_of_a_user_outside_the_group_is_refused(tmp_path: Path) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody")
    root = _root(tmp_path / "root", shared=True)
    f = root / "index" / "data.mdb"
    os.chown(f, nobody.pw_uid, -1)
    from kvstore.local.modes import group_name

    with pytest.raises(UnsafeRootError) as e:
        open_store(root, create=False)
    assert str(e.value) == (f"{f} is owned by nobody, who is not a member of group "
                            f"{group_name(os.getgid())}: a shared root's files must be its "
                            "members'; kvstore refuses to open it")


@_as_root
def test_an_index_file_of_another_user_in_a_private_root_is_refused(tmp_path: Path) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody")
    root = _root(tmp_path / "root", shared=False)
    f = root / "index" / "lock.mdb"
    os.chown(f, nobody.pw_uid, -1)
    with pytest.raises(UnsafeRootError) as e:
        open_store(root, create=False)
    assert str(e.value) == (f"{f} is owned by nobody, not by the root's owner "
                            f"{pwd.getpwuid(os.geteuid()).pw_name}; kvstore refuses to open it")


_HOLD_KVSTORE = """
import sys, time
from kvstore.index import Index
idx = Index(__import__("pathlib").Path(sys.argv[1]), durable=False)
with idx.write():
    print("ready", flush=True)
    time.sleep(60)
"""
_HOLD_LMDB = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], max_dbs=8, subdir=True)
with env.begin(write=True):
    print("ready", flush=True)
    time.sleep(60)
"""


def _holding(script: str, index: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", script, str(index)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


@pytest.mark.parametrize("holder", ["kvstore", "lmdb"])
def test_a_held_write_lock_is_waited_for_a_bounded_time_and_its_holder_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holder: str) -> None:
    root = _root(tmp_path / "root", shared=False)
    toks = tokens_for(2, 40)
    monkeypatch.setenv("KVSTORE_LOCK_TIMEOUT", "1.5")
    s = open_store(root, create=False)  # opened before: the open itself would wait too
    p = _holding(_HOLD_KVSTORE if holder == "kvstore" else _HOLD_LMDB, root / "index")
    try:
        t0 = time.monotonic()
        with pytest.raises(IndexBusyError) as e:
            s.save(toks, make_cache(toks))
        waited = time.monotonic() - t0
        assert 1.5 <= waited < 5, waited
        cmd = f"{sys.executable} -c"
        if holder == "kvstore":
            assert str(e.value).startswith(
                f"{root / 'index'}: pid {p.pid}, {cmd} ")
            assert str(e.value).endswith(
                " has held the index's write lock for over 1.5 s; gave up waiting "
                "($KVSTORE_LOCK_TIMEOUT sets the wait)")
        else:
            assert str(e.value).startswith(
                f"{root / 'index'}: LMDB's write lock has been held for over 1.5 s by a "
                f"process that is not a kvstore writer (processes with the index open: "
                f"pid {p.pid}, {cmd} ")
        # the command line: one line, exit 2, within the bound too
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "kvstore", "--root", str(root), "compact",
                            "--grace", "0"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.startswith(f"kvstore: error: {root / 'index'}: ") and \
            r.stderr.count("\n") == 1 and f"pid {p.pid}" in r.stderr, r.stderr
        assert time.monotonic() - t0 < 30
    finally:
        p.kill()
        p.wait(30)
    # the holder gone, the same store writes at once
    assert s.save(toks, make_cache(toks)).created
    s.close()
