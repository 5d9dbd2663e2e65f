"""The composer: Store over the root (the local tier) and the tiers below it."""

from .opening import StoreOptions
from .store import Entry, EntryInfo, Known, Match, Stats, Store, default_root

__all__ = ["Entry", "EntryInfo", "Known", "Match", "Stats", "Store", "StoreOptions",
           "default_root"]
