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

from ..catalog import keys as P
from ..catalog.find import deepest_reached, find
from ..errors import ManifestError
from ..local import LocalCatalog, LocalReader
from ..schema import Namespace

NAMESPACES_TTL = 60.0  # seconds a listing of the root's namespaces is reused
PARTING_CANDIDATES = 8  # entries at the deepest shared block whose tokens a parting reads
NEXT_TOKENS = 16  # of the stored side at a parting, for the log's excerpt

_ns_dec = msgspec.json.Decoder(Namespace)


def shared_blocks(reader: LocalReader, tk: P.TokenKeys) -> int:
    """How many leading full blocks of the query some entry of its namespace holds."""
    keys = tk.chain
    if reader.bisect:
        return max(deepest_reached(reader, keys), 0)
    for k in range(len(keys) - 1, 0, -1):  # a root without reach markers: walk down
        if reader.reaches(k, keys[k]):
            return k
    return 0


class Diagnosis:
    """The miss reasons of one store; thread-safe (it caches the root's namespaces)."""

    def __init__(self, catalog: LocalCatalog,
                 keys_for: Callable[[Any, Namespace], P.TokenKeys]) -> None:
        self.catalog = catalog
        self.keys_for = keys_for
        self._lock = threading.Lock()
        self._namespaces: tuple[float, list[Namespace]] | None = None

    def reason(self, tokens: Any, ns: Namespace, reused: int, *, remote_down: bool
               ) -> str | None:
        """Why the root gave no more than ``reused`` leading tokens of ``tokens``.

        ``shallow``: entries of ``ns`` hold more of the query's leading blocks than
        ``reused``, but none can be cut back to serve them (a hybrid's or a sliding
        window's entries serve only their exact length); ``remote_timeout``: the remote
        tier was not heard (``remote_down``); with nothing reused, ``other_model`` when an
        entry of another namespace of the same ``ns`` holds a prefix of the query, else
        ``no_entry``. None: a partial reuse that the root could not have bettered.
        """
        tk = self.keys_for(tokens, ns)
        with self.catalog.reader() as r:
            shared = shared_blocks(r, tk) * tk.block_tokens
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
            with self.catalog.reader() as r:
                if shared_blocks(r, tk2) > 0 or find(r, tk2) is not None:
                    return "other_model"
        return "no_entry"

    def parting(self, tokens: Any, ns: Namespace) -> tuple[int, list[int] | None]:
        """How many leading tokens of ``tokens`` the deepest entry of ``ns`` shares with it,
        exactly (not by whole blocks), and that entry's next tokens (up to
        :data:`NEXT_TOKENS`) when it goes on past them (None: it ends there, the prompt
        only extends it, or nothing is shared).

        Bisects to the deepest block some entry shares (as :meth:`reason` does), then reads
        the tokens of at most :data:`PARTING_CANDIDATES` trimmable entries listed there
        (those nearest the query's own next tokens) and as many non-trimmable ones (by
        their reach markers): whatever the number of entries, a bounded cost.
        """
        tk = self.keys_for(tokens, ns)
        best, theirs = 0, None
        with self.catalog.reader() as r:
            k = shared_blocks(r, tk)
            if not r.reaches(k, tk.chain[k]):
                return 0, None
            base = k * tk.block_tokens
            probe = P.encode_tail(tk.tokens[base: base + P.TAIL])
            before, after = r.neighbors(tk.chain[k], probe, PARTING_CANDIDATES)
            digests = [v[-32:] for v in after + before]
            _, reach = r.neighbors(P.reach_key(tk.chain[k]), b"\0", PARTING_CANDIDATES)
            for digest in digests[:PARTING_CANDIDATES] + reach[:PARTING_CANDIDATES]:
                try:
                    m = r.manifest(digest)
                except ManifestError:
                    continue
                if m is None:
                    continue
                n = P.common_tokens(m.tokens, tk.le)
                goes_on = m.n_tokens > n and n < len(tk)
                if n > best or (n == best and goes_on and theirs is None):
                    best = n
                    theirs = (list(P.tokens_from_le(m.tokens[4 * n: 4 * (n + NEXT_TOKENS)]))
                              if goes_on else None)
        return best, theirs

    def namespaces(self) -> list[Namespace]:
        """The namespaces of the root's entries (listed at most every ``NAMESPACES_TTL`` s)."""
        now = time.monotonic()
        with self._lock:
            if self._namespaces is not None and now - self._namespaces[0] < NAMESPACES_TTL:
                return self._namespaces[1]
        names = self.catalog.namespace_names()
        found = []
        for name in sorted(names):
            try:
                found.append(_ns_dec.decode(name))
            except msgspec.DecodeError:
                continue  # a damaged record: verify reports it; here it names nothing
        with self._lock:
            self._namespaces = (now, found)
        return found
