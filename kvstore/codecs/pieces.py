"""Cutting a run of memoryviews into fixed-size blocks (no copy)."""

from __future__ import annotations

from collections.abc import Iterable


def cut(pieces: Iterable[memoryview], size: int) -> list[list[memoryview]]:
    """Regroup ``pieces`` into blocks of ``size`` bytes each (the last may be short)."""
    out: list[list[memoryview]] = []
    cur: list[memoryview] = []
    room = size
    for p in pieces:
        while len(p):
            k = min(room, len(p))
            cur.append(p[:k])
            p, room = p[k:], room - k
            if room == 0:
                out.append(cur)
                cur, room = [], size
    if cur:
        out.append(cur)
    return out
