"""Warm memory for a process that restores again and again (issue 37).

A restore fills arrays that MLX allocates for it. MLX keeps freed buffers for reuse
only up to its cache limit, which on Linux is small (about 24 MiB measured, with
mlx 0.32 on the CPU), so in a server every restore of a 256 MiB cache gets fresh
pages, and the kernel faults in and zero-fills each of them: on a virtual machine
that hands idle memory back to its host, more than the copy itself costs.

:func:`restoring` is called by every restore before it allocates (``reader.load_arrays``).
From the **second** restore of a process on, MLX's cache limit is raised to the
largest restore seen lately (plus a quarter for the arrays' spare rows), never above
:data:`CAP` (4 GiB, and at most an eighth of the machine's memory), so that the
buffers a finished restore (or a cache that was dropped) gives back are there for
the next one. A limit someone set higher is left as it is.

The memory is given back:

- when the process has not restored for :data:`IDLE_SECONDS`: the limit returns to
  what it was and ``mx.clear_cache()`` frees what the cache holds (a watcher thread);
- under pressure: a restore that finds less than :data:`LOW_MEMORY` of the machine's
  memory available (``MemAvailable``) does the same instead of raising the limit.

What it costs a process that restores once (a command, a script): nothing. Its one
restore changes no limit, so its memory goes back as it did before.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

#: The most memory the raised cache limit may keep warm.
CAP = 4 << 30
#: The raised limit comes back down after this many seconds without a restore.
IDLE_SECONDS = 30.0
#: Below this share of the machine's memory available, nothing is kept warm.
LOW_MEMORY = 0.10
_SLACK = 1.25  # the arrays' spare rows (a KVCache's step) and allocator rounding
_RECENT = 8  # restores whose sizes set the limit


def _meminfo() -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) in bytes; None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo", "rb") as f:
            text = f.read(8192).decode("ascii", "replace")
    except OSError:
        return None
    vals: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable"):
            try:
                vals[name] = int(rest.split()[0]) * 1024
            except (IndexError, ValueError):
                return None
    if "MemTotal" not in vals or "MemAvailable" not in vals:
        return None
    return vals["MemTotal"], vals["MemAvailable"]


@dataclass
class WarmState:
    """What the process-wide policy did so far (for tests and ``kvstore bench``)."""

    restores: int = 0
    raised_to: int = 0  # the limit kvstore set; 0: none (the limit is MLX's or the user's)
    original: int | None = None  # the limit found before the first raise
    given_back: int = 0  # times the raised limit was taken back (idle or pressure)
    refused_low_memory: int = 0  # restores that found memory short and kept nothing warm


class WarmMemory:
    """The policy of the module docstring; one per process (:data:`POLICY`)."""

    def __init__(self, *, cap: int = CAP, idle_seconds: float = IDLE_SECONDS,
                 low_memory: float = LOW_MEMORY) -> None:
        self.cap = cap
        self.idle_seconds = idle_seconds
        self.low_memory = low_memory
        self.state = WarmState()
        self._recent: list[int] = []
        self._lock = threading.Lock()
        # one watcher thread while memory is kept warm, sleeping until the idle deadline
        # (pushed on by each restore): a thread started a restore cost about 0.5 ms of the
        # restore's own time, before its first read
        self._watcher: threading.Thread | None = None
        self._deadline = 0.0

    def restoring(self, nbytes: int) -> None:
        """A restore of ``nbytes`` is about to allocate its arrays."""
        with self._lock:
            st = self.state
            st.restores += 1
            self._recent = (self._recent + [nbytes])[-_RECENT:]
            if st.restores < 2:
                return
            info = _meminfo()
            cap = self.cap if info is None else min(self.cap, info[0] // 8)
            want = min(cap, int(max(self._recent) * _SLACK))
            if info is not None and info[1] < self.low_memory * info[0]:
                st.refused_low_memory += 1
                self._give_back_locked()
                return
            if want > st.raised_to:
                prev = mx.set_cache_limit(want)
                if st.original is None:
                    st.original = prev
                if prev > want and not st.raised_to:
                    mx.set_cache_limit(prev)  # someone's own limit is higher: keep it
                    st.original = None
                else:
                    st.raised_to = want
            self._arm_locked()

    def give_back(self) -> None:
        """Return the cache limit to what it was and free what MLX's cache holds."""
        with self._lock:
            self._give_back_locked()

    def _give_back_locked(self) -> None:
        st = self.state
        self._watcher = None  # a watcher still asleep finds it is not the one and leaves
        if not st.raised_to:
            return
        mx.set_cache_limit(st.original if st.original is not None else 0)
        mx.clear_cache()
        st.raised_to, st.original = 0, None
        st.given_back += 1

    def _arm_locked(self) -> None:
        self._deadline = time.monotonic() + self.idle_seconds
        if self._watcher is None:
            t = threading.Thread(target=self._watch, name="kvstore-warm-memory", daemon=True)
            self._watcher = t
            t.start()

    def _watch(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                if self._watcher is not me:  # given back meanwhile (and maybe re-armed)
                    return
                left = self._deadline - time.monotonic()
                if left <= 0:  # no restore for idle_seconds
                    self._give_back_locked()
                    return
            time.sleep(left)

    def _after_fork(self) -> None:
        # the child has no watcher thread; its copy of MLX's limit is the parent's
        self._lock = threading.Lock()
        self._watcher = None


POLICY = WarmMemory()
os.register_at_fork(after_in_child=POLICY._after_fork)


def restoring(nbytes: int) -> None:
    """Called by a restore before it allocates ``nbytes`` of arrays (see the module)."""
    POLICY.restoring(nbytes)
