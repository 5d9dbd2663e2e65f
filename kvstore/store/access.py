"""Access stamps, lookup counts and request counts: advisory, so batched off the caller's path.

They order evictions (``last_access``) and feed ``kvstore stats`` (the lookups and hits,
and the per-tier request counts of :mod:`kvstore.store.usage`).
A timer writes them ``ACCESS_FLUSH_SECONDS`` after the first one; ``close()`` and
interpreter exit write what is left. A forked child drops its parent's pending
counts (the parent writes them).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable

from ..errors import KVStoreError
from ..local import Root
from .usage import Counts, add_usage

_log = logging.getLogger("kvstore")

ACCESS_FLUSH_SECONDS = 1.0  # how long access stamps may wait in memory before a write


class AccessLog:
    """The pending stamps of one open store, and the timer that writes them."""

    def __init__(self, root: Root, *, read_only: bool) -> None:
        self.root = root
        self.read_only = read_only
        self._lock = threading.Lock()  # guards the pending counts and the timer
        self._flush_lock = threading.Lock()  # one flush at a time, none after close
        self._hits: dict[bytes, int] = {}
        self._lookups = 0
        self._found = 0
        self._usage = Counts()  # requests not yet added to the root's counts
        self._pid = os.getpid()  # whose the pending counts are
        self._timer: threading.Timer | None = None
        self._closed = False
        self._exit_hook = _exit_flush(self)
        atexit.register(self._exit_hook)

    def note(self, digest: bytes | None = None, *, lookup: bool = False) -> None:
        """Count a ``lookup`` and/or a load of entry ``digest`` (a hit); a timer writes them."""
        with self._lock:
            self._adopt_after_fork()
            if digest is not None:
                self._hits[digest] = self._hits.get(digest, 0) + 1
                self._found += 1
            if lookup:
                self._lookups += 1
            self._arm()

    def touch(self, digest: bytes) -> None:
        """Stamp entry ``digest``'s last access (no hit, no lookup); a timer writes it."""
        with self._lock:
            self._adopt_after_fork()
            self._hits.setdefault(digest, 0)
            self._arm()

    def note_request(self, prompt_tokens: int, reused_tokens: int, tier: str | None,
                     miss: str | None) -> None:
        """Count one request (checked by the caller); a timer writes the counts."""
        with self._lock:
            self._adopt_after_fork()
            self._usage.note(prompt_tokens, reused_tokens, tier, miss)
            self._arm()

    def _arm(self) -> None:
        """Start the flush timer unless one runs; the caller holds ``_lock``."""
        if self._timer is not None or self._closed:
            return
        timer = self._timer = threading.Timer(ACCESS_FLUSH_SECONDS, self._timed_flush)
        timer.daemon = True
        timer.name = "kvstore-access-stamps"
        timer.start()

    def flush(self) -> None:
        """Write the pending counts now. Best effort: an index that cannot be written
        (a read-only root, say) drops them with a log line instead of failing the
        restore or the close that flushes them; a store opened read-only drops them
        silently."""
        with self._flush_lock:
            if not self._closed:
                self._write()

    def close(self, then: Callable[[], None]) -> None:
        """Write what is pending, then call ``then`` (closing the index) once, under the
        flush lock so that no timer writes after it."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        with self._flush_lock:
            if self._closed:
                return
            self._write()
            self._closed = True
            then()
        atexit.unregister(self._exit_hook)

    def _write(self) -> None:
        """Write the pending counts; the caller holds ``_flush_lock``."""
        with self._lock:
            self._adopt_after_fork()
            hits, self._hits = self._hits, {}
            lookups, found = self._lookups, self._found
            self._lookups = self._found = 0
            usage, self._usage = self._usage, Counts()
        if self.read_only:
            return
        try:
            self.root.record_access(hits, lookups=lookups, found=found)
        except KVStoreError as e:
            _log.warning("kvstore: access stamps not recorded: %s", e)
        add_usage(self.root, usage)

    def _adopt_after_fork(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._hits, self._lookups, self._found, self._timer = {}, 0, 0, None
            self._usage = Counts()

    def _timed_flush(self) -> None:
        with self._lock:
            self._timer = None
        self.flush()


def _exit_flush(log: AccessLog) -> Callable[[], None]:
    """An exit hook that writes ``log``'s pending stamps; it does not keep the log alive."""
    ref = weakref.ref(log)

    def hook() -> None:
        s = ref()
        if s is not None:
            s.flush()

    return hook
