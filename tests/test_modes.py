"""Who may use a root, tried with real OS users (issue 30, item 1).

The users and their group are made here with ``useradd``/``groupadd`` (so the test
runs as root, as CI does) and removed afterwards. Each user's part runs in a child
process that drops to that user (tests/helpers/as_user.py).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli.cli_helpers import run_here
from helpers.kv import make_cache, open_store, tokens_for

from kvstore.errors import RootSettingsError
from kvstore.local.modes import world_readable

AS_USER = Path(__file__).resolve().parent / "helpers" / "as_user.py"
_needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd: it creates OS users (CI runs its slow step as root)",
)


def root_only(fn: Any) -> Any:
    """Slow (a child process per user and step, each importing MLX); root only."""
    return pytest.mark.slow(_needs_root(fn))


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: list[int]

    def run(self, ops: list[dict[str, Any]], umask: int = 0o022) -> list[Any]:
        arg = {"uid": self.uid, "gid": self.gid, "groups": self.groups, "umask": umask,
               "ops": ops}
        p = subprocess.run([sys.executable, str(AS_USER), json.dumps(arg)],
                           capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stderr
        out: list[Any] = json.loads(p.stdout.strip().splitlines()[-1])
        return out


@dataclass(frozen=True)
class Users:
    group: str
    gid: int
    a: User  # in the group
    b: User  # in the group
    c: User  # not in it


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def users() -> Iterator[Users]:
    tag = f"kvt{os.getpid() % 100000}"
    group, names = f"{tag}g", [f"{tag}{x}" for x in "abc"]
    made: list[str] = []
    try:
        _sh("groupadd", group)
        for i, n in enumerate(names):
            extra = ["-G", group] if i < 2 else []
            _sh("useradd", "-M", "-U", "-s", "/usr/sbin/nologin", *extra, n)
            made.append(n)
        import grp
        import pwd

        gid = grp.getgrnam(group).gr_gid

        def user(n: str) -> User:
            pw = pwd.getpwnam(n)
            groups = [pw.pw_gid] + [g.gr_gid for g in grp.getgrall() if n in g.gr_mem]
            return User(n, pw.pw_uid, pw.pw_gid, groups)

        yield Users(group, gid, user(names[0]), user(names[1]), user(names[2]))
    finally:
        for n in made:
            subprocess.run(["userdel", n], capture_output=True, timeout=60)
        subprocess.run(["groupdel", group], capture_output=True, timeout=60)


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory where every user can make one (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="kvstore-modes-"))
    d.chmod(0o1777)  # like /tmp: anyone makes a directory in it, and owns it
    try:
        yield d
    finally:
        shutil.rmtree(d)


def _modes(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (itself included): (mode bits, gid)."""
    out = {".": (stat.S_IMODE(root.stat().st_mode), root.stat().st_gid)}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(root))] = (stat.S_IMODE(st.st_mode), st.st_gid)
    return out


DENIED = {"list": "EACCES", "list_blocks": "EACCES", "read_index": "EACCES", "open": "EACCES"}


@root_only
def test_a_new_root_is_private_to_its_owner_whatever_the_umask(users: Users,
                                                                place: Path) -> None:
    root = place / "r"
    (saved,) = users.a.run([{"op": "save", "root": str(root), "seed": 1, "n": 40}], umask=0)
    assert saved["created"]
    modes = _modes(root)
    blocks = [k for k in modes if k.startswith("blocks/") and len(k) > 10]
    assert len(blocks) == 3 and "index/lock.mdb" in modes and "index/data.mdb" in modes
    for path, (mode, _) in modes.items():
        is_dir = (root / path).is_dir()
        assert mode == (0o700 if is_dir else 0o600), (path, oct(mode))
    assert world_readable(root) == []
    # user B, even in A's group, can neither list nor read nor open it
    (peek,) = users.b.run([{"op": "peek", "root": str(root)}])
    assert peek == DENIED
    # A restores its own entry, bit-exact
    (back,) = users.a.run([{"op": "restore", "root": str(root), "seed": 1, "n": 40}])
    assert back == {"length": 40, "exact": True}


@root_only
def test_a_shared_group_root_is_used_by_both_members_and_no_one_else(users: Users,
                                                                    place: Path) -> None:
    root = str(place / "shared")
    s1 = {"seed": 1, "n": 64, "shared": 48, "root": root}  # 3 blocks in common, 1 own
    s2 = {"seed": 2, "n": 64, "shared": 48, "root": root}
    init, a1 = users.a.run([
        {"op": "cli", "args": ["--root", root, "init", "--shared-group", users.group,
                               "--block-tokens", "16"]},
        {"op": "save", **s1},
    ])
    assert init == {"code": 0, "out": f"Created kvstore root at {root} (blake3, 16 tokens "
                                      f"per block, shared with group {users.group})\n",
                    "err": ""}
    assert a1["created"] and a1["new_bytes"] == 4 * 16 * 64  # 64 bytes of K and V a token
    # B (umask 022, which would take the group's write bit) restores A's entry bit-exact,
    # and its own save shares A's three common blocks: only its last one is new
    b1, b2 = users.b.run([{"op": "restore", **s1}, {"op": "save", **s2}])
    assert b1 == {"length": 64, "exact": True}
    assert b2["created"] and b2["new_bytes"] == 16 * 64
    a2, a3 = users.a.run([{"op": "restore", **s2}, {"op": "restore", **s1}])
    assert a2 == a3 == {"length": 64, "exact": True}
    # compaction by either: B removes A's entry and sweeps A's own block, A then B's
    b3, b4 = users.b.run([{"op": "delete", "root": root, "id": a1["id"]},
                          {"op": "compact", "root": root}])
    assert b3 == {"deleted": True} and b4 == {"freed_blocks": 1}
    a4, a5, a6 = users.a.run([{"op": "delete", "root": root, "id": b2["id"]},
                              {"op": "compact", "root": root}, {"op": "restore", **s2}])
    assert a4 == {"deleted": True} and a5 == {"freed_blocks": 4} and a6["length"] == 0
    # every directory is setgid and the group's, every file group-writable, others nothing
    modes = _modes(Path(root))
    assert not [k for k in modes if k.startswith("blocks/") and len(k) > 10]  # all swept
    for path, (mode, gid) in modes.items():
        is_dir = (Path(root) / path).is_dir()
        assert (mode, gid) == (0o2770 if is_dir else 0o660, users.gid), (path, oct(mode))
    # a user outside the group gets nothing
    (peek,) = users.c.run([{"op": "peek", "root": root}])
    assert peek == DENIED
    with open_store(root, create=False) as s:
        assert s.verify(read_data=True).sound


@root_only
def test_files_made_by_each_member_of_a_shared_root_are_the_groups(users: Users,
                                                                 place: Path) -> None:
    # a user outside the group cannot make a root of that group
    (denied,) = users.c.run([{"op": "cli", "args": ["--root", str(place / "c"), "init",
                                                    "--shared-group", users.group]}])
    assert denied["code"] == 2 and (f"cannot give {place / 'c'} to group {users.group}: "
                                    "Operation not permitted") in denied["err"]
    assert not (place / "c").exists()  # nothing half made
    # an administrator's empty directory for the group (root's, 2770): a member makes the
    # root in it
    root = str(place / "shared")
    os.mkdir(root)
    os.chown(root, -1, users.gid)
    os.chmod(root, 0o2770)
    (init,) = users.a.run([{"op": "cli", "args": ["--root", root, "init", "--shared-group",
                                                  users.group, "--block-tokens", "16"]}])
    assert init["code"] == 0, init
    assert Path(root).stat().st_uid == 0
    a1, b1 = (users.a.run([{"op": "save", "root": root, "seed": 1, "n": 40}], umask=0o077)[0],
              users.b.run([{"op": "save", "root": root, "seed": 2, "n": 40}], umask=0o077)[0])
    assert a1["created"] and b1["created"]
    modes = _modes(Path(root))
    files = {k: v for k, v in modes.items() if not (Path(root) / k).is_dir()}
    assert sum(k.startswith("blocks/") for k in files) == 6
    owners = {(Path(root) / k).stat().st_uid for k in files if k.startswith("blocks/")}
    assert owners == {users.a.uid, users.b.uid}
    for path, (mode, gid) in modes.items():
        is_dir = (Path(root) / path).is_dir()
        assert (mode, gid) == (0o2770 if is_dir else 0o660, users.gid), (path, oct(mode))


def test_an_existing_private_root_is_never_made_shared_silently(tmp_path: Path) -> None:
    root = tmp_path / "r"
    open_store(root).close()
    before = _modes(root)
    with pytest.raises(RootSettingsError, match="is a private root") as e:
        open_store(root, shared_group=os.getgid())
    assert "chgrp -R" in str(e.value)
    assert _modes(root) == before


def test_an_old_world_readable_root_keeps_working_and_verify_notes_it(tmp_path: Path) -> None:
    root = tmp_path / "old"
    with open_store(root) as s:
        pass
    for p in (root, root / "index", root / "blocks"):
        p.chmod(0o755)
    (root / "index" / "data.mdb").chmod(0o644)
    assert world_readable(root) == ["index/data.mdb", "blocks/"]
    with open_store(root) as s:
        toks = tokens_for(1, 40)
        s.save(toks, make_cache(toks))
    # kvstore changed nothing of the old root's own modes (its new block files are private)
    assert stat.S_IMODE((root / "index" / "data.mdb").stat().st_mode) == 0o644
    assert stat.S_IMODE((root / "blocks").stat().st_mode) == 0o755
    r = run_here("--root", root, "verify")
    assert r.code == 0
    assert ("note: any user of this machine can read index/data.mdb and blocks/ (the stored "
            f"prompts' tokens and KV); 'chmod -R go-rwx {root}' makes the root private") in r.out
    assert run_here("--root", root, "verify", "--json").json()["world_readable"] == [
        "index/data.mdb", "blocks/"]
    root.chmod(0o700)  # one private directory on the way is enough
    assert world_readable(root) == []
    assert "note: any user" not in run_here("--root", root, "verify").out


@root_only
@pytest.mark.parametrize("name", ["lock.mdb", "data.mdb"])
def test_a_member_cannot_make_another_open_or_chmod_a_file_outside_the_root(
        users: Users, place: Path, name: str) -> None:
    """Issue 36, item 4: A puts a link to B's private index where the shared root's
    ``index/lock.mdb`` (or ``data.mdb``) was; B's next command refuses it and leaves its
    private file as it was (LMDB would have opened it, kvstore chmodded it to 0660)."""
    shared, private = str(place / "shared"), str(place / "b-private")
    (init,) = users.a.run([{"op": "cli", "args": ["--root", shared, "init", "--shared-group",
                                                  users.group, "--block-tokens", "16"]}])
    assert init["code"] == 0, init
    users.b.run([{"op": "save", "root": private, "seed": 3, "n": 40}])
    target = Path(private) / "index" / "data.mdb"
    before = (stat.S_IMODE(target.stat().st_mode), target.read_bytes())
    assert before[0] == 0o600
    link = str(Path(shared) / "index" / name)
    assert users.a.run([{"op": "link", "path": link, "target": str(target)}]) == ["ok"]
    (ls,) = users.b.run([{"op": "cli", "args": ["--root", shared, "ls"]}])
    assert ls == {"code": 2, "out": "", "err": (
        f"kvstore: error: {link} is a symlink; a root's files must be regular files inside it "
        "(kvstore never opens or changes what a link in a root points to): remove the link "
        "(for data.mdb, put the root's own index back)\n")}
    assert (stat.S_IMODE(target.stat().st_mode), target.read_bytes()) == before
    # B's private root is still B's alone, and sound
    (back,) = users.b.run([{"op": "restore", "root": private, "seed": 3, "n": 40}])
    assert back == {"length": 40, "exact": True}


@root_only
def test_compact_names_a_directory_a_member_left_without_group_write(users: Users,
                                                                      place: Path) -> None:
    """Issue 36, item 4: a fan-out directory without the group's write bit (a member's own
    chmod, or one made by hand) makes another member's compact one line naming it and the
    fix, exit 2; after the fix, the compact frees the blocks."""
    root = str(place / "shared")
    (init,) = users.a.run([{"op": "cli", "args": ["--root", root, "init", "--shared-group",
                                                  users.group, "--block-tokens", "16"]}])
    assert init["code"] == 0, init
    (a1,) = users.a.run([{"op": "save", "root": root, "seed": 1, "n": 40}])
    fans = sorted(p for p in (Path(root) / "blocks").iterdir() if any(p.iterdir()))
    fan = str(fans[0])
    users.a.run([{"op": "chmod", "path": fan, "mode": "2750"},
                 {"op": "delete", "root": root, "id": a1["id"]}])
    compact = {"op": "cli", "args": ["--root", root, "compact", "--grace", "0"]}
    (c,) = users.b.run([compact])
    assert c["code"] == 2, c
    assert c["err"] == (
        f"kvstore: error: {fan}: cannot remove a block: the directory is {users.a.name}'s "
        f"(group {users.group}), mode 2750, which {users.b.name} cannot write; its owner or "
        f"an administrator fixes it: chmod 2770 {fan}\n")
    users.a.run([{"op": "chmod", "path": fan, "mode": "2770"}])
    (c,) = users.b.run([{"op": "cli", "args": ["--root", root, "compact", "--grace", "0",
                                               "--json"]}])
    assert c["code"] == 0, c
    assert not [p for p in (Path(root) / "blocks").rglob("*") if p.is_file()]


_HOLD = """
import json, os, sys, time
from pathlib import Path
from kvstore.index import Index
u = json.loads(sys.argv[2])  # imported as root (the interpreter may be root's alone)
os.setgroups(u["groups"]); os.setgid(u["gid"]); os.setuid(u["uid"])
idx = Index(Path(sys.argv[1]), durable=False, mode=0o660)
with idx.write():
    print("ready", flush=True)
    time.sleep(120)
"""


@root_only
def test_a_member_holding_the_write_lock_stalls_another_for_a_bounded_time(
        users: Users, place: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36, item 4: member A holds the shared root's write lock; member B's compact
    gives up after $KVSTORE_LOCK_TIMEOUT seconds, one line naming A's process, exit 2."""
    root = str(place / "shared")
    (init,) = users.a.run([{"op": "cli", "args": ["--root", root, "init", "--shared-group",
                                                  users.group, "--block-tokens", "16"]}])
    assert init["code"] == 0, init
    a = users.a
    who = json.dumps({"uid": a.uid, "gid": a.gid, "groups": a.groups})
    hold = subprocess.Popen([sys.executable, "-c", _HOLD, str(Path(root) / "index"), who],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout is not None and hold.stdout.readline() == "ready\n"
        monkeypatch.setenv("KVSTORE_LOCK_TIMEOUT", "2")
        t0 = time.monotonic()
        (c,) = users.b.run([{"op": "cli", "args": ["--root", root, "compact"]}])
        assert time.monotonic() - t0 < 90  # a child that imports MLX, then 2 s
        assert c["code"] == 2 and c["out"] == "" and c["err"].count("\n") == 1, c
        assert c["err"].startswith(f"kvstore: error: {Path(root) / 'index'}: pid {hold.pid}, "
                                   f"{sys.executable} -c "), c
        assert c["err"].endswith(" has held the index's write lock for over 2 s; gave up "
                                 "waiting ($KVSTORE_LOCK_TIMEOUT sets the wait)\n"), c
    finally:
        hold.kill()
        hold.wait(30)
    (c,) = users.b.run([{"op": "cli", "args": ["--root", root, "compact"]}])
    assert c["code"] == 0, c
