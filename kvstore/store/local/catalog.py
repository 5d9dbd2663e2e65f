"""Finding the longest usable stored prefix of a query in the index.

Trimmable entries are listed under every chain key ``c_k`` they reach, with
their next tokens as a sorted value: the entry sharing the longest extension
of the query sits next to the query's own position, one seek away.
Non-trimmable entries serve only their exact length; they are found through
the exact keys of each length within the block where the query's chain ends.
Either way the work is bounded by the query, never by the number of entries.

Whether some entry holds the first ``k`` blocks of the query is monotone in
``k`` (trimmable entries are listed at every depth, non-trimmable ones leave a
reach marker at every depth), so the deepest such block is found by bisection
in about log2(blocks) probes; the search then walks down from there only past
blocks whose entries turn out not to serve the query.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...blocks import Digest
from ...catalog import keys as P
from ...codecs import codec_for_record
from ...errors import KVStoreError
from ...index import DeletePlan, Index
from ...schema import Layer, Manifest, decode_manifest

_log = logging.getLogger("kvstore")
SCAN = 8  # prefix values examined on each side of a lookup's probe
REACH_META = b"reach-markers"  # meta key: every non-trimmable entry has its reach markers


@dataclass(frozen=True)
class Match:
    """The longest usable stored prefix of a query."""

    digest: Digest  # the entry's (its manifest's) digest
    length: int
    exact: bool  # the entry's tokens are exactly the query
    trimmable: bool
    n_tokens: int  # the entry's own length (>= length)
    where: str = "local"  # "remote": on the remote tier; loading it pulls it to this root

    @property
    def entry_id(self) -> str:
        """The entry's id: its digest in hex."""
        return self.digest.hex()


def trimmable(layers: Sequence[Layer]) -> bool:
    """Whether every layer of an entry can serve a shorter prefix."""
    return all(codec_for_record(layer).trimmable(layer) for layer in layers)


def prefix_items(
    keys: list[bytes], toks: Sequence[int], T: int, can_trim: bool, digest: bytes
) -> list[tuple[bytes, bytes]]:
    """The prefix-db values of an entry.

    Trimmable: its next tokens under every depth. Non-trimmable: its digest
    under the state key of its last depth and under the reach key of every depth.
    """
    if not can_trim:
        return [(P.state_key(keys[-1]), digest)] + [(P.reach_key(k), digest) for k in keys]
    return [
        (key, P.prefix_value(toks[k * T : (k + 1) * T], True, digest)) for k, key in enumerate(keys)
    ]


def find(index: Index, txn: Any, tk: P.TokenKeys, *, bisect: bool = True) -> Match | None:
    """The best match for the query ``tk`` (its chain has one key per full block, plus c_0).

    ``bisect=False`` walks every depth from the deepest down: for a root whose
    non-trimmable entries may lack reach markers (see :func:`add_reach_markers`).
    """
    keys, q, q_le, T, algo = tk.chain, tk.tokens, tk.le, tk.block_tokens, tk.algo
    top = deepest_reached(index, txn, keys) if bisect else len(keys) - 1
    for k in range(top, -1, -1):
        best, crowded = None, False
        if index.has_prefix(keys[k], txn):
            best, crowded = _best_trimmable(index, txn, keys[k], k, q, T)
        if crowded or index.has_prefix(P.state_key(keys[k]), txn):
            best = _best_exact(index, txn, keys, k, q, q_le, T, algo, best)
        if best is not None:
            return best
    return None


def deepest_reached(index: Index, txn: Any, keys: list[bytes]) -> int:
    """The deepest ``k`` such that some entry holds the query's first ``k`` blocks (-1: none)."""

    def reached(k: int) -> bool:
        return index.has_prefix(keys[k], txn) or index.has_prefix(P.reach_key(keys[k]), txn)

    if not reached(0):
        return -1
    lo, hi = 0, len(keys) - 1  # reached(lo) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if reached(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def add_reach_markers(index: Index) -> int:
    """Give every non-trimmable entry its reach markers, once per root; returns how many entries.

    Roots written before reach markers existed list a non-trimmable entry only
    under its state key. This finds those keys, recomputes each entry's chain
    from its manifest and adds the markers, then records that the root has them,
    all in one write transaction.
    """
    done = 0
    with index.write() as txn:
        if index.get_meta(REACH_META, txn) is not None:
            return 0
        digests: dict[bytes, None] = {}
        for key, value in index.iter_prefix(txn):
            if len(key) == 33 and key[-1:] == b"s":  # a state key
                digests[value] = None
        for digest in digests:
            raw = index.get_manifest(digest, txn)
            if raw is None:
                continue
            m = decode_manifest(raw)
            c0 = P.root_key(m.namespace, m.codec, m.block_tokens, m.hash)
            for key in P.chain(c0, m.tokens, m.block_tokens, m.hash, m.n_tokens // m.block_tokens):
                index.put_prefix(txn, P.reach_key(key), digest)
            done += 1
        index.put_meta(REACH_META, b"1", txn)
    return done


def _best_trimmable(
    index: Index, txn: Any, key: bytes, k: int, q: Sequence[int], T: int
) -> tuple[Match | None, bool]:
    """The trimmable entry under ``c_k`` sharing the longest extension of ``q`` among the
    query's sorted neighbours, and whether they were crowded.

    Crowded: the farthest neighbour on a side still holds the query's first ``TAIL``
    tokens past the block, so more entries may tie there than the window saw (their
    values cannot tell them apart). The caller then probes the exact keys of the block,
    which find any entry that is exactly a prefix of the query, however many tie.
    """
    base = k * T
    cap = min(T, P.TAIL)
    qtail = list(q[base : base + T])
    probe = P.encode_tail(qtail[:cap])
    before, after = index.neighbors(key, probe, SCAN, txn)
    crowded = len(qtail) > cap and any(
        len(side) == SCAN and P.split_value(side[-1])[0] == qtail[:cap]
        for side in (before, after)
    )
    best: Match | None = None
    for v in after + before:
        etail, _, digest = P.split_value(v)
        lcp = P.common_prefix(etail, qtail)
        n_entry = base + len(etail)
        if len(etail) == cap:  # the entry goes on past what the value holds
            if lcp == cap:  # and so may the match: compare the entry's own tokens
                raw = index.get_manifest(digest, txn)
                if raw is None:
                    continue
                m = decode_manifest(raw)
                lcp = P.common_prefix(P.tokens_from_le(m.tokens[4 * base : 4 * (base + T)]), qtail)
                n_entry = m.n_tokens
            else:
                rec = index.get_entry(digest, txn)
                if rec is None:
                    continue
                n_entry = rec.n_tokens
        length = min(base + lcp, len(q), n_entry)
        if length <= 0:
            continue
        exact = n_entry == len(q) == length
        if best is None or (length, exact) > (best.length, best.exact):
            best = Match(Digest(digest), length, exact, True, n_entry)
    return best, crowded


def _best_exact(
    index: Index,
    txn: Any,
    keys: list[bytes],
    k: int,
    q: Sequence[int],
    q_le: bytes,
    T: int,
    algo: str,
    best: Match | None,
) -> Match | None:
    """The longest entry ending in block ``k`` whose tokens are exactly a prefix of ``q``."""
    floor = max(k * T - 1, best.length if best is not None else 0)  # exclusive
    if best is not None and not best.exact and best.length == len(q):
        floor -= 1  # an exact entry of the same length is better
    for length in range(min(len(q), (k + 1) * T - 1), floor, -1):
        digest = index.find_exact(P.exact_key_for(keys, q_le, length, T, algo), txn)
        if digest is None:
            continue
        raw = index.get_manifest(digest, txn)
        if raw is None:
            continue
        can_trim = trimmable(decode_manifest(raw).layers)
        return Match(Digest(digest), length, length == len(q), can_trim, length)
    return best


def delete_plan(m: Manifest, digest: bytes) -> DeletePlan:
    """The blocks, prefix keys and exact key entry ``digest`` (of manifest ``m``) holds."""
    toks = P.tokens_from_le(m.tokens)
    T = m.block_tokens
    c0 = P.root_key(m.namespace, m.codec, T, m.hash)
    keys = P.chain(c0, m.tokens, T, m.hash, m.n_tokens // T)
    can_trim = trimmable(m.layers)
    return DeletePlan(
        blocks=m.block_digests(),
        prefix_items=prefix_items(keys, toks, T, can_trim, digest),
        exact_key=P.exact_key_for(keys, m.tokens, m.n_tokens, T, m.hash),
    )


def has_reach_markers(index: Index, *, writable: bool = True) -> bool:
    """Whether lookups may bisect: the root's non-trimmable entries all have reach markers.

    A root from before reach markers gets them here, once; if it cannot be
    written, its lookups walk every depth instead (slower, same answers).
    """
    if index.get_meta(REACH_META) is not None:
        return True
    if not writable:
        return False
    try:
        n = add_reach_markers(index)
    except KVStoreError as e:
        _log.warning("kvstore: lookups will not bisect: %s", e)
        return False
    if n:
        _log.info("kvstore: added reach markers for %d non-trimmable entries", n)
    return True
