"""The index's write gate: every write transaction of kvstore waits here, for a bounded
time, before LMDB's own writer lock (which waits forever and cannot say who holds it).

Two locks stand in front of ``env.begin(write=True)``:

1. ``index/write.lock``, an empty file every kvstore writer locks (``flock``) for the
   length of its write transaction, after a lock of its own threads; a writer that
   gives up names the holder (Linux's ``/proc/locks`` lists it). The lock goes with
   its process: a killed writer holds nothing. Nothing is written to the file, so a
   dry run changes no byte of the root.
2. LMDB's writer mutex, which a process that is not a kvstore writer (a member's own
   script, ``mdb_*`` tools) may hold: a probe thread takes and drops it first, so a
   writer that gives up says so, naming the processes that have the index open
   (Linux's ``/proc/locks``).

Waiting past ``timeout`` is an :class:`IndexBusyError`; the waiting process changes
nothing. ``$KVSTORE_LOCK_TIMEOUT`` (seconds) sets the default.
"""

from __future__ import annotations

import errno
import fcntl
import os
import queue
import stat
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import UnsafeRootError
from .errors import IndexBusyError, IndexStoreError

ENV_TIMEOUT = "KVSTORE_LOCK_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
LOCK_NAME = "write.lock"
_FLAGS = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)  # flock only


def default_timeout() -> float:
    """``$KVSTORE_LOCK_TIMEOUT`` in seconds, else :data:`DEFAULT_TIMEOUT`."""
    raw = os.environ.get(ENV_TIMEOUT, "")
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise IndexStoreError(f"${ENV_TIMEOUT} must be a positive number of seconds, "
                              f"got {raw[:40]!r}")
    return value


def _command(pid: int) -> str:
    """The command line of ``pid`` (Linux), cut short; "" when unknown."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(200)
    except OSError:
        return ""
    text = raw.decode("utf-8", "replace")  # another user's: no control characters shown
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:80]


def _who(pid: int) -> str:
    cmd = _command(pid)
    return f"pid {pid}" + (f", {cmd}" if cmd else "")


def lock_holders(path: Path) -> list[int]:
    """The pids (this one left out) that hold a lock on the file ``path``: Linux's
    ``/proc/locks``; empty elsewhere."""
    try:
        st = os.stat(path)
        with open("/proc/locks", "rb") as f:
            text = f.read(1 << 20).decode("ascii", "replace")
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = set()
    for line in text.splitlines():
        parts = line.split()
        if "->" in parts or len(parts) < 6:  # a waiter, not a holder
            continue
        if parts[5] == want and parts[4].isdigit():
            pids.add(int(parts[4]))
    pids.discard(os.getpid())
    return sorted(pids)


class WriteGate:
    """The gate of one environment in this process (see the module's docstring)."""

    def __init__(self, path: Path, env: Any, mode: int, shared: bool) -> None:
        self.path = path
        self._env = env
        self._mode, self._shared = mode, shared
        self._threads = threading.Lock()
        self._fd: int | None = None
        self._probes: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
        self._prober: threading.Thread | None = None
        self._pending = 0  # probes asked for and not yet through LMDB's mutex
        self._count = threading.Lock()  # of _pending: two threads change it

    def close(self) -> bool:
        """Drop the lock file; True when a probe still waits inside LMDB for its mutex
        (the environment must then stay open: closing it under that thread hangs)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        stuck = self._pending > 0
        if self._prober is not None:
            self._probes.put(_STOP)
            if not stuck:  # it is idle: gone once it reads the stop
                self._prober.join(5)
            self._prober = None
        return stuck

    def _file(self) -> int:
        if self._fd is not None:
            return self._fd
        p = self.path / LOCK_NAME
        try:
            fd = os.open(p, _FLAGS, self._mode)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafeRootError(
                    f"{p} is a symlink; a root's files must be regular files inside it "
                    "(kvstore never opens or changes what a link in a root points to): "
                    "remove the link") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise UnsafeRootError(f"{p} is not a regular file of its own (a hard link or "
                                  "another kind of file); kvstore refuses to write it: "
                                  "remove it")
        if self._shared and st.st_uid == os.geteuid() and \
                stat.S_IMODE(st.st_mode) != self._mode:
            os.fchmod(fd, self._mode)  # the group's bits the umask took away
        self._fd = fd
        return fd

    def acquire(self, timeout: float) -> None:
        """Hold the gate (both locks free for this thread), or IndexBusyError after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        if not self._threads.acquire(timeout=timeout):
            raise IndexBusyError(
                f"{self.path}: another thread of this process (pid {os.getpid()}) has held "
                f"the index's write lock for over {timeout:g} s; gave up waiting "
                f"(${ENV_TIMEOUT} sets the wait)")
        try:
            fd = self._file()
            pause = 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise IndexBusyError(self._busy(fd, timeout)) from None
                    time.sleep(min(pause, left))
                    pause = min(pause * 2, 0.05)
            try:
                self._probe(deadline, timeout)
            except BaseException:
                fcntl.flock(fd, fcntl.LOCK_UN)
                raise
        except BaseException:
            self._threads.release()
            raise

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    def _busy(self, fd: int, timeout: float) -> str:
        pids = lock_holders(self.path / LOCK_NAME)
        holder = ", ".join(_who(p) for p in pids) if pids else "another kvstore process"
        return (f"{self.path}: {holder} has held the index's write lock for over "
                f"{timeout:g} s; gave up waiting (${ENV_TIMEOUT} sets the wait)")

    # --- LMDB's own writer mutex ----------------------------------------------

    def _probe(self, deadline: float, timeout: float) -> None:
        """Wait until LMDB's writer mutex is free (a probe thread takes and drops it), or
        IndexBusyError at ``deadline``. Only a process that is not a kvstore writer can
        hold it now: every kvstore writer holds the file lock first."""
        if self._prober is None:
            self._prober = threading.Thread(target=self._probing, daemon=True,
                                            name="kvstore-index-probe")
            self._prober.start()
        done = threading.Event()
        with self._count:
            self._pending += 1
        self._probes.put(done)
        if done.wait(max(0.0, deadline - time.monotonic())):
            return
        others = lock_holders(self.path / "lock.mdb")
        who = (f"processes with the index open: {', '.join(_who(p) for p in others)}"
               if others else "no other process shows it open")
        raise IndexBusyError(
            f"{self.path}: LMDB's write lock has been held for over {timeout:g} s by a "
            f"process that is not a kvstore writer ({who}); gave up waiting "
            f"(${ENV_TIMEOUT} sets the wait)")

    def _probing(self) -> None:
        while True:
            done = self._probes.get()
            if done is _STOP:
                return
            try:
                txn = self._env.begin(write=True)
                txn.abort()
            except Exception:  # noqa: BLE001 - the real transaction reports it
                pass
            with self._count:
                self._pending -= 1
            done.set()


_STOP = threading.Event()
