"""One LMDB environment per process and path: opened once, counted, reopened after ``fork``."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

import lmdb

from ._gate import WriteGate
from .errors import IndexStoreError

_lock = threading.Lock()
# path -> (pid, environment, open count, identity of its lock file or None)
_ENVS: dict[str, tuple[int, lmdb.Environment, int, tuple[int, int] | None]] = {}
# path -> its named databases, opened once with the environment (see _open_dbs)
_DBS: dict[str, dict[str, Any]] = {}
_DB_NAMES = ("manifests", "prefix", "exact", "refs", "entries", "meta")
# path -> the write gate of its environment (None: read-only), shared like the environment
_GATES: dict[str, WriteGate | None] = {}
# Environments inherited across fork, by path. A child must not use them, and py-lmdb
# refuses to open the same files twice in one process, so the child closes the
# inherited one and opens its own. The close must come first: closing any fd of
# lock.mdb drops every POSIX lock this process holds on it, and after the fresh
# open that would release the child's own lock (a newly starting process could
# then think it is alone and reset the reader table). Before it, the child holds
# none. (A transaction another thread had open at fork time would be aborted by
# that close, clearing the parent's reader slot: fork while no thread is inside
# a transaction, as pre-forking servers do.)
_INHERITED: dict[str, lmdb.Environment] = {}


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at fork time
    _INHERITED.update((key, held[1]) for key, held in _ENVS.items())
    _ENVS.clear()
    _DBS.clear()
    _GATES.clear()  # the child opens its own lock file: a flock is shared across a fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def lock_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the environment's lock file; None when it has none (read-only fs)."""
    try:
        st = os.stat(path / "lock.mdb")
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _open_dbs(env: lmdb.Environment, readonly: bool) -> dict[str, Any]:
    """The named databases, opened once per environment, under ``_lock``.

    py-lmdb's ``open_db`` begins its own write transaction while holding the GIL:
    called while another thread of this process has a write transaction open (or
    is opening a database too), it waits for LMDB's writer lock and that thread
    waits for the GIL, forever. Opened here, before any other thread has the
    environment, it cannot meet another of our write transactions.
    """
    return {
        name: env.open_db(name.encode(), dupsort=(name == "prefix"), create=not readonly)
        for name in _DB_NAMES
    }


def open_env(
    path: Path, *, durable: bool, map_size: int, readonly: bool, mode: int = 0o600,
    timeout: float = 60.0,
) -> tuple[lmdb.Environment, tuple[int, int] | None, dict[str, Any], WriteGate | None]:
    key = str(path.resolve())
    with _lock:
        pid = os.getpid()
        held = _ENVS.get(key)
        if held and held[0] == pid:
            if held[1].flags()["readonly"] and not readonly:
                raise IndexStoreError(
                    f"{path}: already open read-only in this process; close those stores first"
                )
            _ENVS[key] = (pid, held[1], held[2] + 1, held[3])
            return held[1], held[3], _DBS[key], _GATES.get(key)
        inherited = _INHERITED.pop(key, None)
        if inherited is not None:
            inherited.close()  # before this process takes any lock on lock.mdb
        env = lmdb.open(
            key,
            map_size=map_size,
            max_dbs=8,
            max_readers=1024,
            subdir=True,
            sync=durable,
            metasync=durable,
            readonly=readonly,
            lock=True,
            mode=mode,  # of data.mdb and lock.mdb when LMDB creates them (less the umask)
            readahead=False,
            create=not readonly,
        )
        env.reader_check()  # clear reader slots of dead processes
        gate = None if readonly else WriteGate(path, env, mode, shared=bool(mode & 0o070))
        try:
            if gate is not None:  # opening the databases is a write transaction
                gate.acquire(timeout)
            try:
                dbs = _open_dbs(env, readonly)
            finally:
                if gate is not None:
                    gate.release()
        except BaseException:
            _close(env, gate)
            raise
        ident = lock_identity(path)
        _ENVS[key] = (pid, env, 1, ident)
        _DBS[key] = dbs
        _GATES[key] = gate
        return env, ident, dbs, gate


def _close(env: lmdb.Environment, gate: WriteGate | None) -> None:
    """Close ``env``, unless a probe of its gate still waits inside LMDB for the writer
    mutex another process holds: closing it then would hang (or free what that thread
    uses), so it is left open, and never freed, for the process's life."""
    if gate is not None and gate.close():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(env))
        return
    env.close()


def close_env(path: Path) -> None:
    key = str(path.resolve())
    with _lock:
        held = _ENVS.get(key)
        if not held or held[0] != os.getpid():
            return
        if held[2] > 1:
            _ENVS[key] = (held[0], held[1], held[2] - 1, held[3])
            return
        del _ENVS[key]
        _DBS.pop(key, None)
        _close(held[1], _GATES.pop(key, None))
