"""Whether the tiers below the root are asked, and for how long a request waits for them:
the state :class:`~kvstore.store.tiers.Tiers` keeps about each lower tier, in one object.

A tier that failed is **benched** for ``down_for`` seconds (lookups leave it alone). With a
``deadline`` (seconds a lookup and the pull of what it found may take together), a tier
the deadline cut is **slow** for ``slow_for`` seconds (lookups do not wait for it, they
ask it in the background) unless one of those lookups answers within the deadline; and
while ``late_lookups`` lookups the deadline left running are still out, later ones skip
the lower tiers. A request the deadline cut is worth a warning at most every
``warn_every`` seconds. The clock is injectable (tests/test_health.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DOWN_FOR = 30.0  # seconds a failed tier is not asked again by lookups
DEFAULT_DEADLINE = 1.5  # seconds: ``kvstore serve --remote-deadline``
LATE_LOOKUPS = 4  # lookups a deadline left running before later ones skip the lower tiers
SLOW_FOR = 30.0  # seconds lookups do not wait for a tier the deadline cut (asked in the
#                  background meanwhile; lifted when one of them answers in time)
LATE_WARN_EVERY = 60.0  # seconds between two warnings that the deadline cut a request


@dataclass(frozen=True)
class Ask:
    """How a lookup asks one tier now: ``skip`` (why not: it is not waited for), with
    ``background`` when it is still asked off the request; else ``wait`` seconds at most
    (None: no bound), ``cut`` when that is the deadline's rest, not the tier's timeout."""

    skip: str | None = None
    background: bool = False
    wait: float | None = None
    cut: bool = False


class Health:
    """The lower tiers' health (benched, slow, lookups running late) and the request
    deadline; thread-safe."""

    def __init__(self, deadline: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic, down_for: float = DOWN_FOR,
                 slow_for: float = SLOW_FOR, late_lookups: int = LATE_LOOKUPS,
                 warn_every: float = LATE_WARN_EVERY) -> None:
        #: Seconds a lookup and the pull of what it found below the root may take
        #: together (None: each tier's own bounds).
        self.deadline = deadline
        self.clock = clock
        self.down_for = down_for
        self.slow_for = slow_for
        self.late_lookups = late_lookups
        self.warn_every = warn_every
        self._cv = threading.Condition()
        self._down_until: dict[str, float] = {}
        self._slow_until: dict[str, float] = {}
        self._late = 0
        self._warned: float | None = None

    def until(self, deadline: float | None = None) -> float | None:
        """When a request that starts now must be done with the lower tiers, by its own
        ``deadline`` (seconds; None: :attr:`deadline`); None: no deadline."""
        d = self.deadline if deadline is None else deadline
        return None if d is None else self.clock() + d

    def bench(self, name: str) -> None:
        """Leave tier ``name`` alone for ``down_for`` seconds (it failed)."""
        with self._cv:
            self._down_until[name] = self.clock() + self.down_for

    def benched(self, name: str) -> bool:
        """Whether tier ``name`` failed less than ``down_for`` seconds ago."""
        with self._cv:
            return self.clock() < self._down_until.get(name, 0.0)

    def cut(self, name: str) -> None:
        """The deadline cut a lookup of tier ``name``: not waited for during ``slow_for``."""
        with self._cv:
            self._slow_until[name] = self.clock() + self.slow_for

    def unavailable(self, names: Iterable[str]) -> bool:
        """Whether lookups leave one of these tiers alone now, or do not wait for it."""
        with self._cv:
            now = self.clock()
            return any(now < max(self._down_until.get(n, 0.0), self._slow_until.get(n, 0.0))
                       for n in names)

    def ask(self, name: str, timeout: float | None, until: float | None) -> Ask:
        """How a lookup that must be done by ``until`` asks tier ``name`` (whose own
        bound is ``timeout``) now; a :meth:`benched` tier is not asked at all."""
        with self._cv:
            now = self.clock()
            if until is None:
                return Ask(wait=timeout)
            left = until - now
            slow = now < self._slow_until.get(name, 0.0)
            crowded = self._late >= self.late_lookups
            if left <= 0:
                return Ask(skip="no time left")
            if slow:
                return Ask(skip="it was slow", background=not crowded)
            if crowded:
                return Ask(skip="lookups still running")
            if timeout is None or left < timeout:
                return Ask(wait=left, cut=True)
            return Ask(wait=timeout)

    def late(self) -> None:
        """A lookup goes on past its request (the deadline cut it, or it was not waited
        for)."""
        with self._cv:
            self._late += 1

    def answered(self, name: str, began: float, deadline: float | None = None) -> None:
        """A lookup :meth:`late` counted answered; one that took no longer than its
        request's ``deadline`` (None: :attr:`deadline`) lifts the tier's slowness."""
        d = self.deadline if deadline is None else deadline
        with self._cv:
            self._late -= 1
            if d is not None and self.clock() - began <= d:
                self._slow_until.pop(name, None)
            self._cv.notify_all()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until no lookup is late (False on timeout)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._late, timeout)

    def warn_due(self) -> bool:
        """Whether a cut request is worth a warning now (one every ``warn_every`` s)."""
        with self._cv:
            now = self.clock()
            if self._warned is not None and now - self._warned < self.warn_every:
                return False
            self._warned = now
            return True
