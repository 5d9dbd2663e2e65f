"""No cyclic garbage collection while a restore holds its plan.

A restore of a 256 MiB cache (16 layers, 4,096 tokens, 16 blocks) holds about 6,000
small objects at once for a few milliseconds: a memoryview for each head's rows of each
tensor's share of each block, a read for each share, the runs of the plan. They are
freed by reference counting when the restore returns and hold no cycles, but while they
are alive they count towards the collector's thresholds: about eight young collections a
restore, which promote them to the older generations, and then every third restore or so
a full collection, which walks every object of the process (mlx-lm, its tokenizers,
a server's state): 20-40 ms on a 2-core machine, a third of the restore itself.

:func:`paused` disables the collector around the part of a restore that builds and uses
those objects, and enables it again once the last restore in flight (of any thread) is
done, only if it was enabled before. Collection is deferred, not dropped: the objects are
gone by then, so the count they raised is back down, and whatever else the process
allocated meanwhile is collected at its next allocation.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
_reenable = False


@contextmanager
def paused() -> Iterator[None]:
    """The collector disabled for the ``with`` block (nested and concurrent uses share
    one pause; the last to leave restores what the first found)."""
    global _holders, _reenable
    with _lock:
        if _holders == 0:
            _reenable = gc.isenabled()
            if _reenable:
                gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _reenable:
                _reenable = False
                gc.enable()


def _after_fork() -> None:
    # a child forked while another thread was inside a pause would never leave it
    global _lock, _holders, _reenable
    _lock = threading.Lock()
    if _holders and _reenable:
        gc.enable()
    _holders, _reenable = 0, False


os.register_at_fork(after_in_child=_after_fork)
