"""Named crash points: ``KVSTORE_CRASH_AT=<point>`` makes the process SIGKILL itself there.

Tests use them to kill a save, a delete or a compact at each step and check
that the store stays sound. The points (see docs/FORMAT.md):

- ``after_block_write``: a save, after its first new block file is in place
- ``before_commit``: a save, all its blocks on disk, just before the index commit
- ``after_commit``: a save, just after the index commit
- ``delete_before_commit``: a delete or evict, refcounts dropped, not committed
- ``gc_before_unlink``: compact, inside its transaction, before unlinking a block
- ``gc_after_unlink``: compact, after unlinking a block, before the commit

And those of the remote tier (``REMOTE_POINTS``; docs/FORMAT.md, "The remote tier"):

- ``push_after_manifest``: a push, its manifest object put, no block checked yet
- ``push_after_block``: a push, after its first new block object is uploaded
- ``push_before_markers``: a push, every block on the remote, no marker yet
- ``push_before_exact``: a push, its depth markers put, its exact marker not yet
- ``remote_gc_after_list``: remote compact, everything listed, nothing deleted
- ``remote_gc_after_delete``: remote compact, after its first delete, lease still held

And those of ``kvstore model fetch`` (``MODEL_POINTS``, kvstore/mlx_lm/gguf.py):

- ``convert_before_place``: a conversion, every file written in its temporary folder,
  nothing in the target yet
- ``convert_mid_place``: a conversion into an existing directory, its first file moved in
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
REMOTE_POINTS = (
    "push_after_manifest",
    "push_after_block",
    "push_before_markers",
    "push_before_exact",
    "remote_gc_after_list",
    "remote_gc_after_delete",
)
MODEL_POINTS = ("convert_before_place", "convert_mid_place")

_AT = os.environ.get("KVSTORE_CRASH_AT", "")


def crash_point(name: str) -> None:
    """SIGKILL this process when ``KVSTORE_CRASH_AT`` names this point."""
    if _AT and _AT == name:
        os.kill(os.getpid(), signal.SIGKILL)
