"""Sweeping a root's garbage: block files no record names, stale temp files.

Each unlink re-checks, in the write transaction that could see a save commit,
that what it removes is still garbage (see :mod:`kvstore.store.upkeep.gc`).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from typing import Any

from ..._crash import crash_point
from ...blocks import open_real_dir
from ..local.root import Root

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


def stale_tmp(root: Root, grace: float) -> list[str]:
    """Temp files older than the grace whose writer is gone.

    A temp file lives from ``stage`` to ``publish``; its name starts with
    the writer's pid, and a file of a live writer is kept (unless absurdly old)
    so that compaction never makes a save fail.
    """
    now = time.time()
    try:  # through a descriptor that refuses a symlink: never a sweep outside the root
        dfd = open_real_dir(root.blocks.tmp_dir)
    except FileNotFoundError:
        return []
    out: list[str] = []
    try:
        with os.scandir(dfd) as it:
            names = [e.name for e in it]
        for name in names:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            age = now - st.st_mtime
            if age < grace or not stat.S_ISREG(st.st_mode):
                continue
            head = name.split("-", 1)[0]
            if age < TMP_MAX_AGE and head.isdigit() and pid_alive(int(head)):
                continue
            out.append(name)
    finally:
        os.close(dfd)
    return out


def unlink_tmp(root: Root, names: list[str]) -> int:
    """Unlink the named temp files of ``tmp/``; returns how many were there."""
    if not names:
        return 0
    try:
        dfd = open_real_dir(root.blocks.tmp_dir)
    except FileNotFoundError:
        return 0
    n = 0
    try:
        for name in names:
            try:
                os.unlink(name, dir_fd=dfd)
                n += 1
            except FileNotFoundError:
                pass
    finally:
        os.close(dfd)
    return n
