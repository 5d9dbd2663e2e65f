"""Who may use a root: the modes of its directories and files.

A root is private to its owner unless it was created for a group: its
directories are 0700 and its files 0600, whatever the umask. A shared root
(``kvstore init --shared-group GROUP``) has setgid directories owned by GROUP
(mode 2770) and group-writable files (0660), the LMDB lock file included, and
nothing for others. Which of the two a root is, is read from its ``index/``
directory (setgid and group-writable: shared), so every later writer, whoever
it is and whatever its umask, makes files the root's way. An existing root is
never chmodded: a root made before these modes keeps its own.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import RootSettingsError, UnsafeRootError

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
SHARED_DIR, SHARED_FILE = 0o2770, 0o660


@dataclass(frozen=True)
class RootModes:
    """The modes this root's new directories and files get; ``group`` is the gid of a
    shared root (None: private)."""

    dirs: int = PRIVATE_DIR
    files: int = PRIVATE_FILE
    group: int | None = None

    @property
    def shared(self) -> bool:
        return self.group is not None


PRIVATE = RootModes()


def shared_modes(gid: int) -> RootModes:
    return RootModes(SHARED_DIR, SHARED_FILE, gid)


def group_id(group: str | int) -> int:
    """The gid of a group name (or a number); a :class:`RootSettingsError` when unknown."""
    if isinstance(group, int) or group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise RootSettingsError(f"no group named {group!r} on this machine") from None


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def modes_of(path: Path) -> RootModes:
    """The modes of the root at ``path``, read from its ``index/`` directory: setgid and
    group-writable is a root shared with that directory's group; anything else is
    private (a root that does not exist yet too)."""
    try:
        st = os.stat(path / "index")
    except OSError:
        return PRIVATE
    if st.st_mode & stat.S_ISGID and st.st_mode & stat.S_IWGRP:
        return shared_modes(st.st_gid)
    return PRIVATE


def make_dir(path: Path, modes: RootModes) -> bool:
    """Create the directory ``path`` with the root's mode (its parent must exist); False when
    it existed (it is then left as it is). The umask can only take bits away from a
    mkdir, so a shared root's directory is chmodded after it is made."""
    try:
        os.mkdir(path, modes.dirs)
    except FileExistsError:
        return False
    if modes.shared:
        os.chmod(path, modes.dirs)
    return True


def make_root_dir(path: Path, modes: RootModes) -> None:
    """Make the top directory of a new root (its parents as usual); for a shared root give
    it the group and the setgid bit, so what is made inside inherits both.

    A directory already there (empty: the caller checked) keeps its owner; a shared
    root's is given the group, which only its owner (in that group) or root can do.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    made = make_dir(path, modes)
    if modes.group is not None:
        st = os.stat(path)
        try:
            if st.st_gid != modes.group:
                os.chown(path, -1, modes.group)
            if stat.S_IMODE(st.st_mode) != modes.dirs or st.st_gid != modes.group:
                os.chmod(path, modes.dirs)  # only its owner may (an admin's 2770 is fine)
        except PermissionError as e:
            if made:  # leave nothing half made
                os.rmdir(path)
            raise RootSettingsError(
                f"cannot give {path} to group {group_name(modes.group)}: {e.strerror} "
                "(you must own the directory and be a member of the group)"
            ) from None


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def is_member(uid: int, gid: int) -> bool:
    """Whether the user ``uid`` is in the group ``gid`` (its own group, or listed in it)."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return False
    if pw.pw_gid == gid:
        return True
    try:
        return pw.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


_LINK_WHY = ("is a symlink; a root's files must be regular files inside it (kvstore never "
             "opens or changes what a link in a root points to): remove the link (for "
             "data.mdb, put the root's own index back)")


def check_owned(path: Path, st: os.stat_result, modes: RootModes, root_owner: int) -> None:
    """Refuse (:class:`UnsafeRootError`) a file of the root that is a symlink, not a
    regular file, or owned by someone the root does not trust: in a shared root anyone
    outside its group (or root), in a private root anyone but its owner (or root).

    A member of a shared group can replace any file of the root; what kvstore then
    opens or chmods must still be one of the root's own files, never a link out of it
    (to another member's private files) or a file of a user outside the group."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeRootError(f"{path} {_LINK_WHY}")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeRootError(f"{path} is {_kind(st.st_mode)}, not a regular file; kvstore "
                              "refuses to open it")
    if st.st_nlink != 1:  # a hard link to a file elsewhere: as bad as a symlink
        raise UnsafeRootError(f"{path} has {st.st_nlink} hard links: a root's index files "
                              "have one; kvstore refuses to open it")
    uid = st.st_uid
    if uid in (0, root_owner, os.geteuid()) and not modes.shared:
        return
    if modes.group is not None:
        if uid == 0 or is_member(uid, modes.group):
            return
        raise UnsafeRootError(
            f"{path} is owned by {user_name(uid)}, who is not a member of group "
            f"{group_name(modes.group)}: a shared root's files must be its members'; "
            "kvstore refuses to open it")
    raise UnsafeRootError(
        f"{path} is owned by {user_name(uid)}, not by the root's owner "
        f"{user_name(root_owner)}; kvstore refuses to open it")


def check_index_files(idx_dir: Path, modes: RootModes) -> None:
    """Before LMDB opens ``data.mdb`` and ``lock.mdb`` by name (it follows links):
    each absent, or a regular file owned as :func:`check_owned` wants."""
    try:
        owner = os.stat(idx_dir).st_uid
    except OSError:
        return
    for name in ("data.mdb", "lock.mdb"):
        p = idx_dir / name
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        check_owned(p, st, modes, owner)


_NOFOLLOW = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | \
    getattr(os, "O_CLOEXEC", 0)


def fix_file(path: Path, modes: RootModes) -> None:
    """Give a file of a shared root this process made the group bits its umask took away
    (LMDB's data.mdb and lock.mdb); a file of someone else's, or a private root's, is
    left alone. The file is opened without following a link and changed through that
    descriptor (``fchmod``): a link put in its place is refused, never chmodded through."""
    if not modes.shared:
        return
    try:
        fd = os.open(path, _NOFOLLOW)
    except (FileNotFoundError, PermissionError):  # gone, or another member's to fix
        return
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeRootError(f"{path} {_LINK_WHY}") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeRootError(f"{path} is {_kind(st.st_mode)}, not a regular file; "
                                  "kvstore refuses to open it")
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != modes.files:
            os.fchmod(fd, modes.files)
    finally:
        os.close(fd)


def world_readable(path: Path) -> list[str]:
    """What of the root any user of the machine can read: ``index/data.mdb`` (every
    stored prompt's tokens) and ``blocks/`` (the KV), when each directory on the way
    lets others in (a root made before private modes, or opened up by hand); for
    ``verify``'s notes."""
    def others(p: Path, bit: int) -> bool:
        try:
            return bool(os.stat(p).st_mode & bit)
        except OSError:
            return False

    if not others(path, stat.S_IXOTH):
        return []
    out = []
    if others(path / "index", stat.S_IXOTH) and others(path / "index" / "data.mdb",
                                                        stat.S_IROTH):
        out.append("index/data.mdb")
    if others(path / "blocks", stat.S_IXOTH):
        out.append("blocks/")
    return out
