"""Salted tenants' blocks through the bucket (issue 36, item 5): a tenant's entry pushed
from one machine is pulled and restored bit-exact on another, its blocks are its own in
the bucket too, and the remote's verify (reading every byte) finds them sound."""

from __future__ import annotations

from pathlib import Path

from helpers.kv import NS, T, make_cache, matches, tokens_for

import kvstore
from kvstore.schema import Namespace
from kvstore.store.tenants import block_salt, tenant_namespace

A, B = tenant_namespace(NS, "a" * 32), tenant_namespace(NS, "b" * 32)


def _open(root: Path, ns: Namespace, url: str) -> kvstore.Store:
    return kvstore.Store.open(root, namespace=ns, block_tokens=T, durable=False, remote=url,
                              signing_key="")


def test_a_tenants_entry_travels_through_the_bucket(tmp_path: Path, url: str) -> None:
    toks = tokens_for(5, 4 * T + 3)
    digests = {}
    for ns in (NS, A, B):  # one machine stores one prompt for no tenant and two tenants
        with _open(tmp_path / "a", ns, url) as s:
            info = s.save(toks, make_cache(toks))
            digests[ns.ns] = set(s.manifest(info.id).block_digests())
            s.push(60)
    assert not digests[A.ns] & digests[B.ns] and not digests[A.ns] & digests[NS.ns]
    for ns in (A, B):  # another machine: pulls each tenant's entry and restores it
        with _open(tmp_path / f"b-{ns.ns[-1]}", ns, url) as s:
            m = s.lookup(toks)
            assert m is not None and m.where == "remote" and m.length == len(toks)
            cache, n = s.restore(toks)
            assert n == len(toks) and cache is not None and matches(cache, toks, n)
            for d in digests[ns.ns]:
                assert s.local.blocks.path(d).read_bytes().endswith(block_salt(ns))
            assert s.verify(read_data=True).sound
            assert s.remote is not None
            rep = s.remote.verify(read_data=True)
            assert rep.sound and rep.corrupt == [], rep
    with _open(tmp_path / "c", A, url) as s:
        assert s.remote is not None
        fixed = s.remote.verify(read_data=True, repair=True)
        assert fixed.dropped == [] and fixed.deleted_blocks == 0
        assert s.remote.stats().entries == 3
