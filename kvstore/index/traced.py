"""Traced reads: which LMDB reads a piece of index work makes, to replay them as plain gets.

The bench holds a lookup to the machine's limit on the same reads (issue 16): the
same number of ``get``s in one read transaction. A traced transaction records
the database and key of every ``get`` and of every cursor move made through it
(a step to the next or previous duplicate records the cursor's key), and
:func:`replay` makes one ``get`` per record. Nothing on a store's own paths is
traced: only :meth:`Index.traced_read` hands out these proxies.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import lmdb

#: One read of a trace: (the database handle, the key).
IndexRead = tuple[Any, bytes]


class _TracedCursor:
    """The cursor operations the index's reads use, each recorded before it runs."""

    def __init__(self, cur: lmdb.Cursor, db: Any, reads: list[IndexRead]) -> None:
        self._cur, self._db, self._reads = cur, db, reads
        self._key = b""

    def _note(self, key: bytes | None = None) -> None:
        if key is not None:
            self._key = key
        self._reads.append((self._db, self._key))

    def set_key(self, key: bytes) -> bool:
        self._note(bytes(key))
        return bool(self._cur.set_key(key))

    def set_range_dup(self, key: bytes, value: bytes) -> bool:
        self._note(bytes(key))
        return bool(self._cur.set_range_dup(key, value))

    def next_dup(self) -> bool:
        self._note()
        return bool(self._cur.next_dup())

    def prev_dup(self) -> bool:
        self._note()
        return bool(self._cur.prev_dup())

    def last_dup(self) -> bool:
        self._note()
        return bool(self._cur.last_dup())

    def value(self) -> Any:
        return self._cur.value()

    def iternext_dup(self) -> Iterator[Any]:
        while True:
            self._note()
            yield self._cur.value()
            if not self._cur.next_dup():
                return

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        for k, v in self._cur:
            self._note(bytes(k))
            yield k, v


class TracedTxn:
    """A read transaction that records every ``get`` and cursor move made through it."""

    def __init__(self, txn: lmdb.Transaction) -> None:
        self._txn = txn
        self.reads: list[IndexRead] = []

    def get(self, key: bytes, default: Any = None, db: Any = None) -> Any:
        self.reads.append((db, bytes(key)))
        return self._txn.get(key, default, db=db)

    def cursor(self, db: Any = None) -> _TracedCursor:
        return _TracedCursor(self._txn.cursor(db=db), db, self.reads)


def replay(txn: lmdb.Transaction, reads: Sequence[IndexRead]) -> int:
    """One plain ``get`` per read, in ``txn``; returns how many found a value."""
    get = txn.get
    found = 0
    for db, key in reads:
        if get(key, db=db) is not None:
            found += 1
    return found
