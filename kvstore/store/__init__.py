"""The composer: Store and the root parts it puts together (lookup, writer, reader, gc)."""

from .store import Entry, EntryInfo, Match, Stats, Store, default_root

__all__ = ["Entry", "EntryInfo", "Match", "Stats", "Store", "default_root"]
