"""Hints that lie, against the real gateway (issue 36; docs/FORMAT.md, "Signed entries"):
markers, the names of marker objects and a manifest object's ``priority`` metadata are
not signed, so a reader checks each against the (signed) manifest before it uses it. A
forged exact marker, depth markers under another namespace's chain keys, a non-trimmable
entry re-listed as trimmable, and a forged exact marker naming a shorter entry each
restore the right prefix or a clean miss, are counted as refused, and never bench the
remote; a signed entry's priority rewritten in its metadata steers no keyed compaction or
pull."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
import mlx.core as mx
import msgspec
import pytest
from helpers.kv import T, hybrid_cache, make_cache, matches, open_store, tokens_for

import kvstore
from kvstore.catalog import keys as P
from kvstore.remote import Remote
from kvstore.remote.layout import exact_marker, manifest_key, marker_key
from kvstore.schema import Manifest

KEY = "team-signing-key-0123456789abcdef"
OTHER_NS = kvstore.Namespace(model_id="tiny-gc", config_fingerprint="cfg",
                             tokenizer_hash="tok", ns="tenant-b")


def opener(keyed: bool) -> Any:
    def open_(root: Path, url: str, **kw: Any) -> kvstore.Store:
        return open_store(root, remote=url, signing_key=KEY if keyed else "", **kw)
    return open_


def push_all(store: kvstore.Store, entries: dict[str, tuple[list[int], list[Any]]],
             **kw: Any) -> dict[str, str]:
    ids = {name: store.save(toks, cache, **kw).id for name, (toks, cache) in entries.items()}
    st = store.push(60)
    assert (st.entries, st.failed) == (len(entries), 0), st
    return ids


def manifest_of(url: str, eid: str) -> tuple[Manifest, dict[str, str]]:
    r = Remote(url, signing_key="")
    try:
        raw, meta = r.client.get_with_metadata(manifest_key(r.prefix, bytes.fromhex(eid)))
    finally:
        r.close()
    return msgspec.msgpack.decode(raw, type=Manifest), meta


def keys_of(m: Manifest, tokens: list[int], ns: kvstore.Namespace | None = None
            ) -> P.TokenKeys:
    """The chain and exact keys a reader computes for ``tokens`` in namespace ``ns``
    (default: the manifest's), as anyone who knows the prompt can."""
    c0 = P.root_key(ns or m.namespace, m.codec, m.block_tokens, m.hash)
    return P.TokenKeys.of(tokens, c0, m.block_tokens, m.hash)


def put_empty(url: str, keys: list[str]) -> None:
    """Put empty objects (markers) straight into the bucket, as anyone who can write it."""
    r = Remote(url, signing_key="")
    s3 = boto3.client("s3")
    try:
        for k in keys:
            s3.put_object(Bucket=r.url.bucket, Key=r.prefix + k, Body=b"")
    finally:
        r.close()


def prefix_of(url: str) -> str:
    return url.split("/", 3)[3]


def still_in_use(store: kvstore.Store, toks: list[int], refused: int) -> None:
    """The remote was not benched: a genuine entry is found there and restored bit for bit,
    and nothing more was refused."""
    assert not store.tiers.unavailable
    m = store.lookup(toks)
    assert m is not None and (m.where, m.length) == ("remote", len(toks))
    cache, n = store.restore(toks)
    assert n == len(toks) and cache is not None and matches(cache, toks, n)
    assert store.counters.values().remote_refused == refused


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
def test_a_forged_exact_marker_for_an_unstored_prompt(tmp_path: Path, url: str,
                                                      keyed: bool) -> None:
    """``exact/<key of Q>/<P>.t``: Q shares P's first two blocks and has P's length, P is a
    signed entry of other tokens. Q restores P's two shared blocks (the right prefix), not
    P's KV for all of Q."""
    p, r = tokens_for(1, 3 * T + 5), tokens_for(2, 2 * T + 3)
    q = p[: 2 * T] + tokens_for(3, T + 5)
    with opener(True)(tmp_path / "a", url) as a:
        ids = push_all(a, {"p": (p, make_cache(p)), "r": (r, make_cache(r))})
    m, _ = manifest_of(url, ids["p"])
    put_empty(url, [exact_marker("", keys_of(m, q).exact_key(), bytes.fromhex(ids["p"]),
                                 True)])
    with opener(keyed)(tmp_path / "b", url) as b:
        cache, n = b.restore(q)
        assert n == 2 * T and cache is not None and matches(cache, q, n)
        assert b.counters.values().remote_refused == 1
        b.delete(b.lookup(q).entry_id)  # type: ignore[union-attr]  # ask the remote again
        assert b.restore(q)[1] == 2 * T and b.counters.values().remote_refused == 1  # once
        still_in_use(b, r, 1)


def test_depth_markers_under_another_namespace(tmp_path: Path, url: str) -> None:
    """P's markers copied under the chain keys namespace B computes for P's tokens (and its
    exact key): a keyed reader in namespace B misses, four lies refused; P stays P's."""
    p = tokens_for(4, 3 * T + 5)
    with opener(True)(tmp_path / "a", url) as a:
        ids = push_all(a, {"p": (p, make_cache(p))})
    m, _ = manifest_of(url, ids["p"])
    tk, d = keys_of(m, p, OTHER_NS), bytes.fromhex(ids["p"])
    forged = [marker_key("", tk.chain[k], d, len(p), True) for k in range(1, len(p) // T + 1)]
    put_empty(url, [*forged, exact_marker("", tk.exact_key(), d, True)])
    with opener(True)(tmp_path / "b", url) as b:
        assert b.lookup(p, namespace=OTHER_NS) is None
        cache, n = b.restore(p, namespace=OTHER_NS)
        assert (cache, n) == (None, 0)
        assert b.counters.values().remote_refused == len(forged) + 1
        still_in_use(b, p, len(forged) + 1)


def test_a_non_trimmable_entry_listed_as_trimmable(tmp_path: Path, url: str) -> None:
    """A hybrid entry H (KV and an SSM state of all its tokens) gets ``.t`` markers: a query
    of H's first 2 blocks and 3 tokens misses (no KV cut beside H's whole state)."""
    h = tokens_for(5, 4 * T + 5)
    q = h[: 2 * T + 3]
    with opener(True)(tmp_path / "a", url) as a:
        ids = push_all(a, {"h": (h, hybrid_cache(h))})
    m, _ = manifest_of(url, ids["h"])
    tk, d = keys_of(m, h), bytes.fromhex(ids["h"])
    put_empty(url, [marker_key("", tk.chain[k], d, len(h), True)
                    for k in range(1, len(h) // T + 1)])
    with opener(True)(tmp_path / "b", url) as b:
        assert b.lookup(q) is None
        cache, n = b.restore(q)
        assert (cache, n) == (None, 0)
        assert b.counters.values().remote_refused == 2  # the lies at the two depths judged
        assert not b.tiers.unavailable
        m2 = b.lookup(h)
        assert m2 is not None and (m2.where, m2.length, m2.trimmable) == ("remote", len(h),
                                                                        False)
        cache, n = b.restore(h)
        assert n == len(h) and cache is not None and cache[0].offset == len(h)
        assert mx.array_equal(cache[1][0], hybrid_cache(h)[1][0]).item()  # H's own state
        assert b.counters.values().remote_refused == 3  # and the lie beside H at depth 4


def test_a_forged_exact_marker_naming_a_shorter_entry(tmp_path: Path, url: str) -> None:
    """``exact/<key of P + 29 tokens>/<P>.t``: the query restores P whole (its real longest
    prefix), and the remote is not benched (it was, 30 s, with "cannot restore")."""
    p, r = tokens_for(6, 4 * T + 3), tokens_for(7, 2 * T + 1)
    q = p + tokens_for(8, 29)
    with opener(True)(tmp_path / "a", url) as a:
        ids = push_all(a, {"p": (p, make_cache(p)), "r": (r, make_cache(r))})
    m, _ = manifest_of(url, ids["p"])
    put_empty(url, [exact_marker("", keys_of(m, q).exact_key(), bytes.fromhex(ids["p"]),
                                 True)])
    with opener(True)(tmp_path / "b", url) as b:
        for _ in range(2):
            cache, n = b.restore(q)
            assert n == len(p) and cache is not None and matches(cache, q, n)
            assert b.counters.values().remote_refused == 1
            assert b.counters.values().remote_errors == 0
            b.delete(b.lookup(q).entry_id)  # type: ignore[union-attr]
        still_in_use(b, r, 1)


def test_a_rewritten_priority_steers_no_keyed_compaction_or_pull(tmp_path: Path,
                                                                 url: str) -> None:
    """A signed system prompt's manifest object copied onto itself with ``priority: -1``
    (its signatures kept): a keyed compaction still evicts the assistant entry first, and
    a keyed pull records the system prompt as a system prompt."""
    s, u = tokens_for(9, 2 * T), tokens_for(10, 2 * T)
    with opener(True)(tmp_path / "a", url) as a:
        sid = push_all(a, {"s": (s, make_cache(s))}, priority="system")["s"]
        uid = push_all(a, {"u": (u, make_cache(u))})["u"]
    _, meta = manifest_of(url, sid)
    assert meta["priority"] == "2"
    key = manifest_key(prefix_of(url), bytes.fromhex(sid))
    bucket = url.split("/")[2]
    boto3.client("s3").copy_object(Bucket=bucket, Key=key,
                                   CopySource={"Bucket": bucket, "Key": key},
                                   Metadata={**meta, "priority": "-1"},
                                   MetadataDirective="REPLACE")
    assert manifest_of(url, sid)[1]["priority"] == "-1"
    plain = Remote(url, signing_key="")
    try:  # a reader without the key believes the metadata: the test can fail
        assert plain.compact(max_bytes=2 * T * 64, grace=0, dry_run=True).evicted == [sid]
    finally:
        plain.close()
    r = Remote(url, signing_key=KEY)
    try:
        rep = r.compact(max_bytes=2 * T * 64, grace=0, dry_run=True)
        assert (rep.evicted, rep.refused) == ([uid], [])
    finally:
        r.close()
    with opener(True)(tmp_path / "c", url) as c:
        assert sorted(x.digest.hex() for x in c.pull().pulled) == sorted([sid, uid])
        rec = c.local.catalog.records(bytes.fromhex(sid))
        assert rec is not None and rec.priority == 2
