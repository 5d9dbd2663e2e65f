"""Finding the longest usable stored prefix of a query in one tier: :func:`find`, the one
bisection over depth that every tier's lookup runs.

Whether a tier holds an entry with the first ``k`` blocks of the query is monotone in
``k`` (every entry is listed, or leaves a marker, at each depth it reaches), so the
deepest such depth is found by bisection in about log2(blocks) probes. The search then
judges the entries at that depth against the query's own tokens, walking up past
depths whose entries turn out not to serve it. A tier says how it probes a depth and
judges its entries (a :class:`DepthReader`); the search is the same for all.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

from ..blocks import Digest
from .keys import TokenKeys


@dataclass(frozen=True)
class Match:
    """The longest usable stored prefix of a query."""

    digest: Digest  # the entry's (its manifest's) digest
    length: int
    exact: bool  # the entry's tokens are exactly the query
    trimmable: bool
    n_tokens: int  # the entry's own length (>= length)
    where: str = "local"  # the tier that holds it ("remote": loading it pulls it here)

    @property
    def entry_id(self) -> str:
        """The entry's id: its digest in hex."""
        return self.digest.hex()


class DepthReader(abc.ABC):
    """One tier's view for one lookup (a read transaction, a cache of listings)."""

    #: The shallowest depth the tier lists entries under (0: ``c_0`` too).
    first_depth: int = 0
    #: How many depths, from the deepest reached, the search judges (None: all of them).
    walk: int | None = None
    #: False: the tier's listing is not known to be monotone (a root from before reach
    #: markers); every depth is judged, from the deepest down.
    bisect: bool = True

    @abc.abstractmethod
    def reaches(self, k: int, chain_key: bytes) -> bool:
        """Whether some entry holds the query's first ``k`` blocks (``chain_key`` is ``c_k``)."""

    @abc.abstractmethod
    def best_at(self, tk: TokenKeys, k: int) -> Match | None:
        """The best entry listed at depth ``k`` that serves the query ``tk``, or None."""

    def exact_later(self, tk: TokenKeys) -> Callable[[], Match | None] | None:
        """A call that returns the entry that is exactly the query, for a tier whose depths
        do not list it (one shorter than a block, say); it may start its request now. None:
        :meth:`best_at` finds it."""
        return None


def find(reader: DepthReader, tk: TokenKeys, *, floor: int = 0) -> Match | None:
    """The best match for the query ``tk`` that is longer than ``floor`` tokens.

    Depths below ``floor // block_tokens`` are not probed: a caller that holds a match of
    ``floor`` tokens asks a tier only for something longer.
    """
    keys = tk.chain
    deepest = len(keys) - 1
    exact = reader.exact_later(tk)
    best: Match | None = None
    lo = max(reader.first_depth, floor // tk.block_tokens)
    if lo <= deepest:
        if not reader.bisect:
            top = deepest
        else:
            top = deepest_reached(reader, keys, lo, deepest)
        stop = lo if reader.walk is None else max(lo, top - reader.walk + 1)
        for k in range(top, stop - 1, -1):
            best = reader.best_at(tk, k)
            if best is not None:
                break
    if exact is not None:
        hit = exact()
        if hit is not None and (best is None or not best.exact):
            best = hit
    return best if best is not None and best.length > floor else None


def deepest_reached(reader: DepthReader, keys: list[bytes], lo: int = 0,
                    hi: int | None = None) -> int:
    """The deepest ``k`` in ``[lo, hi]`` (``hi``: the query's deepest) that the reader
    reaches, by bisection; ``lo - 1`` when it does not reach ``lo``."""
    hi = len(keys) - 1 if hi is None else hi
    if not reader.reaches(lo, keys[lo]):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if reader.reaches(mid, keys[mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = ["DepthReader", "Match", "deepest_reached", "find"]
