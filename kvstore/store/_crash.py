"""Named crash points: ``KVSTORE_CRASH_AT=<point>`` makes the process SIGKILL itself there.

Tests use them to kill a save, a delete or a compact at each step and check
that the store stays sound. The points (see docs/FORMAT.md):

- ``after_block_write``: a save, after its first new block file is in place
- ``before_commit``: a save, all its blocks on disk, just before the index commit
- ``after_commit``: a save, just after the index commit
- ``delete_before_commit``: a delete or evict, refcounts dropped, not committed
- ``gc_before_unlink``: compact, inside its transaction, before unlinking a block
- ``gc_after_unlink``: compact, after unlinking a block, before the commit
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "after_block_write",
    "before_commit",
    "after_commit",
    "delete_before_commit",
    "gc_before_unlink",
    "gc_after_unlink",
)

_AT = os.environ.get("KVSTORE_CRASH_AT", "")


def crash_point(name: str) -> None:
    """SIGKILL this process when ``KVSTORE_CRASH_AT`` names this point."""
    if _AT and _AT == name:
        os.kill(os.getpid(), signal.SIGKILL)
