"""Compaction's eviction order on the local root: the checkpoints first, thinned
(:func:`~kvstore.catalog.thinning.checkpoint_order`, shared with the remote's
compaction), then mlx-lm's ``CacheOrder`` (:class:`EvictionOrder`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from ...catalog.thinning import CHECKPOINT_PRIORITY, checkpoint_order, level
from ...index import EntryRecord

__all__ = ["EvictionOrder", "CHECKPOINT_PRIORITY", "checkpoint_order", "level"]


class EvictionOrder:
    """``first`` in its order (the checkpoints, thinned), then mlx-lm's ``CacheOrder``:
    per-priority LRU queues and its balance rule."""

    def __init__(
        self, rows: Iterable[tuple[bytes, EntryRecord]], first: Sequence[bytes] = ()
    ) -> None:
        self._first = deque(first)
        early = set(first)
        by_class: dict[int, list[tuple[int, bytes]]] = {0: [], 1: [], 2: []}
        for d, rec in rows:
            if d not in early:
                by_class[min(max(rec.priority, 0), 2)].append((rec.last_access, d))
        self._lrus = [deque(d for _, d in sorted(by_class[p])) for p in (0, 1, 2)]

    def pop(self, skip: set[bytes] | None = None) -> bytes | None:
        """The next victim, or None when every queue is empty."""
        while True:
            d = self._pop()
            if d is None or skip is None or d not in skip:
                return d

    def _pop(self) -> bytes | None:
        if self._first:
            return self._first.popleft()
        lrus = self._lrus
        for i in range(len(lrus) - 1):
            if lrus[i] and len(lrus[i]) >= len(lrus[i + 1]):
                return lrus[i].popleft()
        for q in reversed(lrus):  # only the last is non-empty by now, if any
            if q:
                return q.popleft()
        return None
