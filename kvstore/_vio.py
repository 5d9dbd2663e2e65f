"""Positioned vectored I/O, written once: every buffer filled, every byte written; and
the one durable flush (:func:`full_fsync`).

``os.preadv``/``os.pwritev`` may move fewer bytes than asked (a signal, a
file that ends, a pipe-like filesystem) and take at most IOV_MAX buffers a
call. These loops retry the rest, a batch at a time, without copying: the
caller's memoryviews go to the kernel as they are, and only a buffer cut by a
short transfer is re-sliced (a view, not a copy).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Sequence

from .errors import KVStoreError

__all__ = ["IOV_MAX", "ShortReadError", "cached", "full_fsync", "preadv_all", "pwritev_all"]

class ShortReadError(KVStoreError, EOFError):
    """A positioned read ended at the end of the file before filling its buffers.

    ``offset`` is where the read began, ``want`` the bytes asked for, ``got``
    the bytes read before the end of the file.
    """

    def __init__(self, fd: int, offset: int, want: int, got: int) -> None:
        super().__init__(
            f"fd {fd}: {got} of {want} bytes read at offset {offset}: the file ends at "
            f"byte {offset + got}"
        )
        self.fd, self.offset, self.want, self.got = fd, offset, want, got


#: Buffers handed to one system call (Linux and macOS allow 1024).
IOV_MAX = 1024
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


def cached(fd: int, offsets: Sequence[int]) -> bool | None:
    """Whether the byte at each of ``offsets`` of ``fd`` is in the page cache: a one-byte
    ``preadv`` with ``RWF_NOWAIT`` each, which fails rather than wait for the disk (a few
    microseconds). False at the end of the file; None where the system cannot tell (no
    ``RWF_NOWAIT``: not Linux, or a filesystem that refuses it)."""
    if _NOWAIT is None:
        return None
    probe = [memoryview(bytearray(1))]
    for pos in offsets:
        try:
            if os.preadv(fd, probe, pos, _NOWAIT) != 1:
                return False
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return None
            return False
    return True


def preadv_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Fill every buffer of ``views``, in order, from ``offset`` of ``fd``.

    Raises :class:`ShortReadError` when the file ends first
    (its ``got`` counts the bytes this call read), ``OSError`` when a read fails.
    """
    pos = offset
    for i in range(0, len(views), IOV_MAX):
        batch = views[i : i + IOV_MAX]
        want = sum(v.nbytes for v in batch)
        got = _preadv(fd, batch, pos)
        if got != want:  # short (rare): the rest of this batch, or the end of the file
            _read_rest(fd, batch, pos, got, offset, views)
        pos += want


def _preadv(fd: int, batch: Sequence[memoryview], pos: int) -> int:
    while True:
        try:
            return os.preadv(fd, batch, pos)
        except InterruptedError:  # a signal handler ran and returned: read again
            continue


def _read_rest(
    fd: int, batch: Sequence[memoryview], pos: int, got: int, offset: int,
    views: Sequence[memoryview],
) -> None:
    """Read what ``batch`` still lacks after ``got`` of its bytes came from ``pos``."""
    rest = list(batch)
    while got:
        pos += _consume(rest, got)
        if not rest:
            return
        got = _preadv(fd, rest, pos)
    raise ShortReadError(fd, offset, sum(v.nbytes for v in views), pos - offset)


def _consume(queue: list[memoryview], n: int) -> int:
    """Drop the first ``n`` bytes of ``queue`` (buffers done, then a buffer's head); ``n``."""
    done = n
    while queue and n >= queue[0].nbytes:
        n -= queue.pop(0).nbytes
    if n:
        queue[0] = _as_bytes(queue[0])[n:]
    return done


def _as_bytes(v: memoryview) -> memoryview:
    """``v`` as a flat view of bytes, so a slice cuts bytes, not elements (no copy)."""
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


def pwritev_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Write every buffer of ``views``, in order, from ``offset`` of ``fd``."""
    queue = [v for v in views if v.nbytes]
    at, i = offset, 0
    while i < len(queue):
        try:
            n = os.pwritev(fd, queue[i : i + IOV_MAX], at)
        except InterruptedError:  # a signal handler ran and returned: write again
            continue
        if n == 0:  # no progress on a non-empty write: fail, never spin
            raise OSError(errno.EIO, f"pwritev wrote 0 bytes at offset {at} of fd {fd}")
        at += n
        while i < len(queue) and n >= queue[i].nbytes:
            n -= queue[i].nbytes
            i += 1
        if n:
            queue[i] = _as_bytes(queue[i])[n:]


def full_fsync(fd: int) -> None:
    """Flush ``fd``'s data to stable storage.

    On macOS ``fsync`` hands the data to the drive, whose cache may still lose it on a
    power cut; Apple documents ``fcntl(F_FULLFSYNC)`` for a flush through that cache
    (LMDB uses it for the index too). A filesystem that refuses it (some network and
    FUSE filesystems) gets the plain ``fsync``. Elsewhere ``fsync`` is the flush.
    """
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)
