"""Why a request reused less than it might have: the ``miss`` of the request log.

Asked only after a lookup gave nothing (or nothing deeper than what memory gave), so a
hit costs nothing more. The answer is one of :data:`~kvstore.store.usage.MISS_REASONS`
that the index alone can tell; the ones only a load can tell (a digest that failed, an
entry gone meanwhile) are the caller's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ..index import Index
from ..schema import Namespace
from . import keys as P
from .lookup import deepest_reached, find

NAMESPACES_TTL = 60.0  # seconds a listing of the root's namespaces is reused

_ns_dec = msgspec.json.Decoder(Namespace)


def shared_blocks(index: Index, txn: Any, tk: P.TokenKeys, *, bisect: bool) -> int:
    """How many leading full blocks of the query some entry of its namespace holds."""
    keys = tk.chain
    if bisect:
        return max(deepest_reached(index, txn, keys), 0)
    for k in range(len(keys) - 1, 0, -1):  # a root without reach markers: walk down
        if index.has_prefix(keys[k], txn) or index.has_prefix(P.reach_key(keys[k]), txn):
            return k
    return 0


class Diagnosis:
    """The miss reasons of one store; thread-safe (it caches the root's namespaces)."""

    def __init__(self, index: Index, keys_for: Callable[[Any, Namespace], P.TokenKeys]) -> None:
        self.index = index
        self.keys_for = keys_for
        self._lock = threading.Lock()
        self._namespaces: tuple[float, list[Namespace]] | None = None

    def reason(self, tokens: Any, ns: Namespace, reused: int, *, bisect: bool,
               remote_down: bool) -> str | None:
        """Why the root gave no more than ``reused`` leading tokens of ``tokens``.

        ``shallow``: entries of ``ns`` hold more of the query's leading blocks than
        ``reused``, but none can be cut back to serve them (a hybrid's or a sliding
        window's entries serve only their exact length); ``remote_timeout``: the remote
        tier was not heard (``remote_down``); with nothing reused, ``other_model`` when an
        entry of another namespace of the same ``ns`` holds a prefix of the query, else
        ``no_entry``. None: a partial reuse that the root could not have bettered.
        """
        tk = self.keys_for(tokens, ns)
        with self.index.read() as txn:
            shared = shared_blocks(self.index, txn, tk, bisect=bisect) * tk.block_tokens
        if shared > reused:
            return "shallow"
        if remote_down:
            return "remote_timeout"
        if reused > 0:
            return None
        for other in self.namespaces():
            if other == ns or other.ns != ns.ns:
                continue
            tk2 = self.keys_for(tokens, other)
            with self.index.read() as txn:
                if shared_blocks(self.index, txn, tk2, bisect=bisect) > 0 \
                        or find(self.index, txn, tk2, bisect=bisect) is not None:
                    return "other_model"
        return "no_entry"

    def namespaces(self) -> list[Namespace]:
        """The namespaces of the root's entries (listed at most every ``NAMESPACES_TTL`` s)."""
        now = time.monotonic()
        with self._lock:
            if self._namespaces is not None and now - self._namespaces[0] < NAMESPACES_TTL:
                return self._namespaces[1]
        with self.index.read() as txn:
            names = {rec.namespace for _, rec in self.index.iter_entries(txn)}
        found = []
        for name in sorted(names):
            try:
                found.append(_ns_dec.decode(name))
            except msgspec.DecodeError:
                continue  # a damaged record: verify reports it; here it names nothing
        with self._lock:
            self._namespaces = (now, found)
        return found
