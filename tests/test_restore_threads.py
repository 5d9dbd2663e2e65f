"""A restore from the page cache reads on one thread a core; one that waits on the disk on
READ_WORKERS (kvstore.local.reader.read_threads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.kv import open_store
from test_restore_gc import TOKENS, _cache

from kvstore import _vio
from kvstore.local import reader
from kvstore.local.reader import _by_block, _Read, _RowsRead, read_threads


def _files(root: Path) -> list[str]:
    return sorted(str(p) for p in (root / "blocks").rglob("*") if p.is_file())


def _reads(paths: list[str]) -> tuple[list[list[_Read]], list[int]]:
    """Each file read whole, as two reads of a block's halves."""
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    reads = []
    for slot, (p, fd) in enumerate(zip(paths, fds, strict=True)):
        size = os.stat(p).st_size
        buf = memoryview(bytearray(size))
        half = size // 2
        for off, n in ((0, half), (half, size - half)):
            r = _RowsRead(off, slot, None, buf, off, n, 1, 0, 0)  # type: ignore[arg-type]
            r.fd = fd
            reads.append(r)
    return _by_block(reads), fds


def _evict(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # a page still dirty cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_blocks_in_the_page_cache_read_on_a_thread_a_core_and_evicted_ones_on_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # this machine's 2 cores and 6 read threads, whatever the machine running the test
    monkeypatch.setattr(reader, "CACHED_THREADS", 2)
    monkeypatch.setattr(reader, "READ_WORKERS", 6)
    # where the system cannot tell (no RWF_NOWAIT): READ_WORKERS
    cached = 2 if _vio._NOWAIT is not None else 6
    toks = list(range(TOKENS))
    with open_store(tmp_path / "r") as s:
        s.save(toks, _cache())
        paths = _files(tmp_path / "r")
        assert len(paths) == TOKENS // 16
        for p in paths:
            Path(p).read_bytes()
        blocks, fds = _reads(paths)
        try:
            assert read_threads(blocks) == cached
            _evict(paths[-1:])  # one block away: the disk is waited on
            assert read_threads(blocks) == 6
            Path(paths[-1]).read_bytes()
            assert read_threads(blocks) == cached
        finally:
            for fd in fds:
                os.close(fd)
        # the restore reads right either way
        _evict(paths)
        got, n = s.restore(toks)
        assert n == TOKENS and got is not None
        got, n = s.restore(toks)
        assert n == TOKENS and got is not None
