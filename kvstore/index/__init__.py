"""The LMDB index: manifests, prefix keys, refcounts, stats. The only code that imports lmdb."""

from .errors import IndexBusyError
from .lmdb_index import DEFAULT_MAP_SIZE, Index
from .records import DeletePlan, EntryRecord, RefInfo, SavePlan, Totals, now_ms
from .traced import IndexRead

__all__ = [
    "DEFAULT_MAP_SIZE",
    "DeletePlan",
    "EntryRecord",
    "Index",
    "IndexBusyError",
    "IndexRead",
    "RefInfo",
    "SavePlan",
    "Totals",
    "now_ms",
]
