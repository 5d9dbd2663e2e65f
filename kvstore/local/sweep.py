"""Sweeping a root's garbage: block files no record names, stale temp files.

Each unlink re-checks, in the write transaction that could see a save commit,
that what it removes is still garbage (see :mod:`kvstore.local.gc`).
"""

from __future__ import annotations

import itertools
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._crash import crash_point
from .blocks import denied, open_real_dir
from .root import Root

TMP_MAX_AGE = 24 * 3600.0  # a temp file this old is stale even if its pid looks alive
BATCH = 256  # blocks or entries per write transaction: keeps the writer lock short


def batches(items: list[Any], n: int = BATCH) -> Iterator[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def orphan_files(root: Root, cutoff: int) -> list[tuple[bytes, int]]:
    """The block files older than ``cutoff`` (ms) that no refs record names, with their
    sizes: the files are listed a batch at a time, each batch looked up in one read, so
    what is kept is the orphans, not every block file (a root of 1M blocks)."""
    out: list[tuple[bytes, int]] = []
    files = ((d, st.size) for d, st in root.block_files() if st.mtime * 1000 <= cutoff)
    while batch := list(itertools.islice(files, BATCH)):
        with root.index.read() as txn:
            out += [(d, size) for d, size in batch if root.index.get_ref(d, txn) is None]
    return out


def unlink_orphans(root: Root, orphans: list[tuple[bytes, int]], cutoff: int) -> tuple[int, int]:
    """Unlink planned orphans that still have no refs record and were not touched since
    ``cutoff`` (ms); returns how many files and bytes."""
    idx = root.index
    n = size = 0
    for batch in batches(orphans):
        with idx.write() as txn:
            for d, _ in batch:
                if idx.get_ref(d, txn) is not None:
                    continue  # a save committed it meanwhile
                st = root.blocks.stat(d)
                if st is None or st.mtime * 1000 > cutoff:
                    continue  # gone, or freshened by a save meanwhile
                crash_point("gc_before_unlink")
                if root.blocks.delete(d):
                    n, size = n + 1, size + st.size
                crash_point("gc_after_unlink")
    return n, size


@dataclass(frozen=True)
class TmpFile:
    """A file of ``tmp/``: a write in progress, or one its writer abandoned."""

    name: str
    size: int
    age: float  # seconds since it was last written
    abandoned: bool  # its writer (the pid its name starts with) is gone: nothing will publish it


@dataclass(frozen=True)
class TempFiles:
    """What ``tmp/`` holds (``kvstore stats``): every file, and those abandoned."""

    files: int = 0
    bytes: int = 0
    abandoned_files: int = 0
    abandoned_bytes: int = 0


def tmp_files(root: Root) -> list[TmpFile]:
    """Every regular file of ``tmp/``, with its size, age and whether it is abandoned.

    A temp file lives from ``stage`` to ``publish``, both in the process whose pid
    its name starts with; once that process is gone (a save killed midway, by Ctrl-C
    or a crash) nothing can publish the file. Processes sharing a root must see each
    other's pids, as LMDB's own reader-slot cleanup already requires.
    """
    now = time.time()
    try:  # through a descriptor that refuses a symlink: never a sweep outside the root
        dfd = open_real_dir(root.blocks.tmp_dir)
    except FileNotFoundError:
        return []
    out: list[TmpFile] = []
    try:
        with os.scandir(dfd) as it:
            names = [e.name for e in it]
        for name in names:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            head = name.split("-", 1)[0]
            gone = head.isdigit() and not pid_alive(int(head))
            out.append(TmpFile(name, st.st_size, now - st.st_mtime, gone))
    finally:
        os.close(dfd)
    return out


def temp_files(root: Root) -> TempFiles:
    """The totals of :func:`tmp_files`."""
    files = tmp_files(root)
    gone = [f for f in files if f.abandoned]
    return TempFiles(len(files), sum(f.size for f in files), len(gone), sum(f.size for f in gone))


def stale_tmp_files(root: Root, grace: float) -> list[TmpFile]:
    """The temp files a compact removes: every abandoned one at once (its writer is gone:
    waiting protects no one), one of a live writer only when absurdly old (its pid was
    reused), any other once it is older than the grace. A live writer's file is never
    taken, so compaction never makes a save fail."""
    out = []
    for f in tmp_files(root):
        named = f.name.split("-", 1)[0].isdigit()
        if f.abandoned or (f.age >= grace and (not named or f.age >= TMP_MAX_AGE)):
            out.append(f)
    return out


def unlink_tmp(root: Root, names: list[str]) -> tuple[int, int]:
    """Unlink the named temp files of ``tmp/``; returns how many were there, and their bytes."""
    if not names:
        return 0, 0
    try:
        dfd = open_real_dir(root.blocks.tmp_dir)
    except FileNotFoundError:
        return 0, 0
    n = size = 0
    try:
        for name in names:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                continue
            except PermissionError:
                raise denied(root.blocks.tmp_dir, "remove a temp file") from None
            n, size = n + 1, size + st.st_size
    finally:
        os.close(dfd)
    return n, size
