"""Failed pushes tried again: after a growing pause, a bounded number of times within a
bounded time (:class:`PushRetry`), then given up (counted by the caller, and kept: the
next explicit push, or the push at close, tries it once more)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PushRetry:
    """How a push that failed is tried again: after ``first`` seconds, doubling up to
    ``cap``, at most ``attempts`` tries in all and none begun ``give_up_after`` seconds
    past the first failure; then it is given up."""

    attempts: int = 5
    first: float = 1.0
    cap: float = 30.0
    give_up_after: float = 120.0

    def pause(self, failures: int) -> float:
        """Seconds before the try that follows ``failures`` failed ones."""
        return float(min(self.cap, self.first * 2 ** (failures - 1)))


@dataclass
class _Failed:
    first: float  # monotonic time of the first failure
    failures: int = 0
    due: float | None = None  # when it is tried again; None: given up


class Retries:
    """The entries whose push failed, and when each is tried again. Not thread-safe: its
    owner (:class:`~kvstore.store.tiers.Tiers`) holds its lock around every call."""

    def __init__(self) -> None:
        self._failed: dict[bytes, _Failed] = {}

    def __len__(self) -> int:
        return len(self._failed)

    def failed(self, digest: bytes, now: float, policy: PushRetry) -> int | None:
        """Note a failed try: None when it is tried again (after ``policy``'s pause), else
        how many tries failed (it is given up now)."""
        f = self._failed.setdefault(digest, _Failed(now))
        f.failures += 1
        due = now + policy.pause(f.failures)
        if f.failures < policy.attempts and due - f.first < policy.give_up_after:
            f.due = due
            return None
        f.due = None
        return f.failures

    def scheduled(self) -> int:
        """Entries that will be tried again (not given up)."""
        return sum(f.due is not None for f in self._failed.values())

    def done(self, digest: bytes) -> None:
        """Its push succeeded."""
        self._failed.pop(digest, None)

    def next_due(self, now: float) -> float | None:
        """Seconds until the next try is due (None: none is scheduled)."""
        due = [f.due for f in self._failed.values() if f.due is not None]
        return None if not due else min(due) - now

    def due(self, now: float) -> list[bytes]:
        """The entries due to be tried again now (handed over: not due again unless that
        try fails too)."""
        out = [d for d, f in self._failed.items() if f.due is not None and f.due <= now]
        for d in out:
            self._failed[d].due = None
        return out

    def take(self) -> list[bytes]:
        """Every entry, given up or not, forgotten here (a push tries them now, afresh)."""
        out, self._failed = list(self._failed), {}
        return out
