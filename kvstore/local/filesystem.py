"""Refuse roots on network filesystems, where LMDB's locks and mmap are unsafe."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UnsupportedFilesystemError

NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "fuse.sshfs", "afs", "ceph"})


def filesystem_type(path: Path) -> str | None:
    """The fstype of the mount holding ``path`` (Linux /proc/mounts), or None."""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, fstype = "", None
    for parts in mounts:
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, parts[2]
    return fstype


def check_filesystem(path: Path) -> None:
    fstype = filesystem_type(path)
    if fstype in NETWORK_FS:
        raise UnsupportedFilesystemError(
            f"{path} is on a {fstype} filesystem; LMDB needs a local disk (set KVSTORE_ROOT)"
        )
