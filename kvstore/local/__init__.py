"""The local tier: a root on this machine's disk, as one package.

``Root`` (``root.py``) is the tier: its settings, its LMDB catalog (``catalog.py``,
``LocalCatalog``, over the index in ``index/``, which nothing outside this package
imports), its block files (``blocks.py``, ``LocalBlockStore``) and who may use it
(``modes.py``). The data path (``saving.py`` and ``writer.py``, a save; ``restore.py``
and ``reader.py``, a restore) and the upkeep (``gc.py``, compaction as a plan;
``verify.py`` and ``repair.py``, verification and repair as a plan; ``sweep.py``,
orphans and temp files) all take a ``Root``; ``views.py`` is what the command line and
the bench read of the index.
"""

from ..index import EntryRecord, IndexBusyError, IndexRead, Totals, now_ms
from .blocks import LocalBlockStore, open_real_dir
from .catalog import LocalCatalog, LocalReader
from .root import Root, default_root, has_root

__all__ = [
    "EntryRecord",
    "IndexBusyError",
    "IndexRead",
    "LocalBlockStore",
    "LocalCatalog",
    "LocalReader",
    "Root",
    "Totals",
    "default_root",
    "has_root",
    "now_ms",
    "open_real_dir",
]
