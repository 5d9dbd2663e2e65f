"""A real store held at a gate, to keep the write-behind worker's snapshots queued."""

from __future__ import annotations

import threading
from typing import Any

import kvstore


class SlowStore:
    """A real store whose saves wait for a gate. ``entered`` is set once the worker is
    inside a save, so a test knows the worker holds a snapshot before it queues more."""

    def __init__(self, store: kvstore.Store) -> None:
        self._store = store
        self.gate = threading.Event()
        self.entered = threading.Event()

    def save(self, *args: Any, **kw: Any) -> Any:
        self.entered.set()
        self.gate.wait(30)
        return self._store.save(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
