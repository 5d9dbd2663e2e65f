"""What one open store did, counted in this process (for ``kvstore serve``'s ``/metrics``).

Unlike the request counts (:mod:`.usage`), these are not written to the root: they are a
process's own, from zero at open, as a Prometheus counter is.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class CounterValues:
    """A snapshot of :class:`StoreCounters`."""

    evicted_entries: int = 0  # entries a byte budget evicted after a save
    freed_bytes: int = 0  # block bytes those evictions unlinked (after the grace)
    corrupt_blocks: int = 0  # blocks a restore found bad (moved to quarantine/)
    remote_pulls: int = 0  # entries (or prefixes) pulled from the remote into the root
    remote_pulled_bytes: int = 0
    remote_pushes: int = 0  # entries published to the remote
    remote_pushed_bytes: int = 0
    remote_errors: int = 0  # remote lookups, pulls and pushes that failed or timed out
    remote_refused: int = 0  # remote entries refused: not signed with the signing key (each once)


class StoreCounters:
    """Thread-safe counters; :meth:`add` from any thread, :meth:`values` to read them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = {f.name: 0 for f in fields(CounterValues)}

    def add(self, **counts: int) -> None:
        """Add to the named counters (a name :class:`CounterValues` lacks is a KeyError)."""
        with self._lock:
            for name, n in counts.items():
                if name not in self._n:
                    raise KeyError(name)
                self._n[name] += n

    def values(self) -> CounterValues:
        with self._lock:
            return CounterValues(**self._n)
