"""The order in which compaction evicts checkpoints (issue 26), in every tier (the local
root's compaction, kvstore.local.gc; the remote's, kvstore.remote.gc): before
every other entry, the intermediate ones thinned out first, the deepest of each
conversation last.

A checkpoint (priority ``"checkpoint"``, saved part-way through a prefill) is worth less
than the entries mlx-lm's server keeps (a conversation's ends), and a conversation's
intermediate checkpoints are worth less than its deepest one: the deepest serves every
prompt that goes on past it (all the questions about one document), an intermediate one
only a prompt that parts from the conversation before the next checkpoint (an edit).
So compaction takes, in order:

1. the **intermediate** checkpoints (some other checkpoint of the namespace extends
   their tokens), by level: first those at odd multiples of the interval, then at odd
   multiples of twice the interval, and so on (the level of a depth ``n`` is the number
   of trailing zero bits of ``n``), least recently used first within a level. Each
   level gone doubles the spacing of what is left, in every conversation at once,
   instead of emptying one conversation while another keeps its finest checkpoints;
2. the **deepest** checkpoint of each conversation, least recently used first;
3. then the other entries as mlx-lm's ``LRUPromptCache.CacheOrder.pop`` takes them
   (:class:`EvictionOrder`), so each tier behaves like the memory tier in front of it:
   one least-recently-used queue per priority (assistant, user, system); take from the
   lowest class whose queue is at least as long as the next class's, else move up.

Evicting a checkpoint is evicting an entry like any other (its blocks' refcounts, prefix
keys and exact key go in the same transaction locally, its markers before its manifest
remotely), so nothing is left pointing at it; an intermediate checkpoint whose
extensions are evicted first simply becomes the deepest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from .records import PRIORITIES

__all__ = ["CHECKPOINT_PRIORITY", "EvictionOrder", "Ranked", "checkpoint_order", "level"]

#: The priority of a checkpoint (``EntryRecord.priority``, ``Records.priority``).
CHECKPOINT_PRIORITY = PRIORITIES["checkpoint"]


class Ranked(Protocol):
    """What the order reads of an entry's record (a local ``EntryRecord`` has it; the
    remote's compaction makes one per manifest)."""

    @property
    def priority(self) -> int: ...
    @property
    def namespace(self) -> str: ...
    @property
    def n_tokens(self) -> int: ...
    @property
    def last_access(self) -> float: ...


R = TypeVar("R", bound=Ranked)


def level(n_tokens: int) -> int:
    """How coarse a checkpoint's depth is: the trailing zero bits of ``n_tokens``."""
    return (n_tokens & -n_tokens).bit_length() - 1 if n_tokens > 0 else 0


def checkpoint_order(
    rows: Iterable[tuple[bytes, R]], tokens_of: Callable[[bytes], bytes | None]
) -> list[bytes]:
    """The checkpoints among ``rows`` (digest, record) in the order to evict them.

    ``tokens_of(digest)`` gives an entry's tokens as stored (u32 little-endian), None
    when its manifest is gone (it is then left out: another process removed it).
    """
    found: list[tuple[bytes, R, bytes]] = []
    for d, rec in rows:
        if rec.priority != CHECKPOINT_PRIORITY:
            continue
        toks = tokens_of(d)
        if toks is not None:
            found.append((d, rec, toks))
    # Sorted by (namespace, tokens as bytes), whatever starts with an entry's tokens
    # comes right after it: an entry is extended iff its successor starts with it.
    found.sort(key=lambda x: (x[1].namespace, x[2]))
    thin: list[tuple[int, float, bytes]] = []
    deepest: list[tuple[float, bytes]] = []
    for i, (d, rec, toks) in enumerate(found):
        nxt = found[i + 1] if i + 1 < len(found) else None
        extended = (nxt is not None and nxt[1].namespace == rec.namespace
                    and len(nxt[2]) > len(toks) and nxt[2].startswith(toks))
        if extended:
            thin.append((level(rec.n_tokens), rec.last_access, d))
        else:
            deepest.append((rec.last_access, d))
    return [d for *_, d in sorted(thin)] + [d for _, d in sorted(deepest)]


class EvictionOrder:
    """``first`` in its order (the checkpoints, thinned), then mlx-lm's ``CacheOrder``:
    per-priority LRU queues and its balance rule; ``last`` (in its order) after everything
    else (the budget after a save puts the most recently used entries there, so that what a
    request has just written is not the first thing it evicts)."""

    def __init__(self, rows: Iterable[tuple[bytes, Ranked]], first: Sequence[bytes] = (),
                 last: Sequence[bytes] = ()) -> None:
        late = set(last)
        self._first = deque(d for d in first if d not in late)
        self._last = deque(last)
        early = set(first) | late
        by_class: dict[int, list[tuple[float, bytes]]] = {0: [], 1: [], 2: []}
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
        if self._last:
            return self._last.popleft()
        return None

    def drain(self) -> list[bytes]:
        """Every victim left, in order."""
        out: list[bytes] = []
        while (d := self._pop()) is not None:
            out.append(d)
        return out
