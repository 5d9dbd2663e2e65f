"""MLX after ``fork``: a clear error instead of a hang.

MLX runs each thread's work on a scheduler thread it starts at that thread's
first evaluation. ``fork`` copies only the calling thread, so in the child the
forking thread's stream still names a scheduler that does not exist there, and
its next ``mx.eval`` waits forever. kvstore notes every thread on which it
evaluated MLX arrays; in a child forked from such a thread, the store's next
evaluation on it raises :class:`~kvstore.errors.ForkedProcessError` instead.
(A new thread of the child gets a stream of its own and works.) What the caller
evaluated outside kvstore is not seen here: the supported pattern is to fork
before using MLX (or to start workers with ``spawn``) and open the store in the
child.
"""

from __future__ import annotations

import os
import threading

from ..errors import ForkedProcessError

_used: set[int] = set()  # threads of this process on which kvstore evaluated MLX
_dead: tuple[int, int] | None = None  # (thread, parent pid): this child's inherited stream


def _after_fork_in_child() -> None:
    global _dead
    me = threading.get_ident()
    if me in _used:
        _dead = (me, _parent)
    _used.clear()


def _before_fork() -> None:
    global _parent
    _parent = os.getpid()


_parent = os.getpid()
os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def mlx_guard() -> None:
    """Call before kvstore evaluates MLX arrays on this thread.

    Raises :class:`ForkedProcessError` on the thread of a forked child whose
    parent had evaluated MLX arrays through kvstore on it.
    """
    me = threading.get_ident()
    if _dead is not None and _dead[0] == me:
        raise ForkedProcessError(
            f"this process (pid {os.getpid()}) was forked from pid {_dead[1]} after that "
            "process had evaluated MLX arrays; MLX would hang here. Fork before using MLX "
            "(or start workers with multiprocessing's 'spawn' method) and open the store "
            "in the child"
        )
    _used.add(me)
