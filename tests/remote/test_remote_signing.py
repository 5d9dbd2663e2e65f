"""Signed entries against the real gateway (docs/FORMAT.md, "Signed entries"): machines
that share the signing key share entries; an entry without the key's signature (pushed by
a machine without it, put into the bucket with boto3, signed with another key, signed for
another store, or a signed manifest tampered with) is never restored or pulled by them,
is counted and logged once, and drives no deletion by their compact or verify --repair.
Every restore of a signed entry is checked bit for bit (``matches``)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import msgspec
import pytest
from helpers.kv import T, make_cache, matches, open_store, tokens_for

import kvstore
from kvstore.blocks import hash_bytes
from kvstore.catalog.records import Records, records_of
from kvstore.remote import Remote
from kvstore.remote import catalog as catalog_module
from kvstore.remote.layout import ACCESS, manifest_key
from kvstore.schema import Manifest

KEY = "team-signing-key-0123456789abcdef"
OTHER_KEY = "someone-elses-key-0123456789abcd"


def keyed(root: Path, url: str, **kw: Any) -> kvstore.Store:
    return open_store(root, remote=url, signing_key=KEY, **kw)


def keyless(root: Path, url: str, **kw: Any) -> kvstore.Store:
    return open_store(root, remote=url, signing_key="", **kw)


def save_and_push(store: kvstore.Store, tokens: list[int], cache_of: list[int] | None = None
                  ) -> str:
    """Save ``tokens`` (with the KV of ``cache_of``: a poisoned entry) and push it."""
    eid = store.save(tokens, make_cache(cache_of or tokens)).id
    st = store.push(60)
    assert (st.entries, st.failed) == (1, 0), st
    return eid


def objects(url: str) -> dict[str, float]:
    """Every object of the remote (but the access records a compaction merges): key -> mtime."""
    r = Remote(url, signing_key="")
    try:
        return {o.key: o.mtime for o in r.client.list(r.prefix)
                if not o.key.startswith(r.prefix + ACCESS)}
    finally:
        r.close()


def manifest_of(url: str, eid: str) -> tuple[bytes, dict[str, str]]:
    r = Remote(url, signing_key="")
    try:
        return r.client.get_with_metadata(manifest_key(r.prefix, bytes.fromhex(eid)))
    finally:
        r.close()


def inject(url: str, m: Manifest, tag: str | None) -> Records:
    """Put a manifest and its markers straight into the bucket with boto3 (``tag``: the
    signature object metadata it carries), as anyone with write access to it can."""
    rec = records_of(m)
    r = Remote(url, signing_key="")
    s3 = boto3.client("s3")
    try:
        meta = {"priority": "1", **({"kvstore-sig": tag} if tag else {})}
        s3.put_object(Bucket=r.url.bucket, Key=manifest_key(r.prefix, rec.digest),
                      Body=rec.manifest, Metadata=meta)
        for k in r.catalog.marker_keys(rec):
            s3.put_object(Bucket=r.url.bucket, Key=k, Body=b"")
    finally:
        r.close()
    return rec


def expected_tag(url: str, raw: bytes, key: str = KEY) -> str:
    """The signature a keyed machine must put, computed here from the bucket's settings."""
    r = Remote(url, signing_key="")
    try:
        s = json.loads(r.client.get(r.prefix + "kvstore.json"))
    finally:
        r.close()
    store = (f"{url} hash={s['hash']} block_tokens={s['block_tokens']} "
             f"state_block_bytes={s['state_block_bytes']} created_at={s['created_at']}")
    mac = hmac.new(key.encode(), b"kvstore manifest hmac-sha256-v1\0" + store.encode() + b"\0"
                   + raw, hashlib.sha256)
    return "hmac-sha256-v1:" + mac.hexdigest()


def refusals(caplog: pytest.LogCaptureFixture, eid: str) -> int:
    return sum(1 for r in caplog.records if "refused" in r.getMessage() and eid in r.getMessage())


def test_machines_with_the_key_share_signed_entries(tmp_path: Path, url: str) -> None:
    toks = tokens_for(1, 6 * T + 5, shared=2 * T)
    with keyed(tmp_path / "a", url) as a:
        eid = save_and_push(a, toks)
    raw, meta = manifest_of(url, eid)
    assert meta["kvstore-sig"] == expected_tag(url, raw)  # same PUT, beside the exact bytes
    assert hash_bytes("blake3", raw).hex() == eid  # the name is still the bytes' digest
    for name, opener in (("b", keyed), ("c", keyless)):  # a reader without the key reads it
        with opener(tmp_path / name, url) as b:
            q = toks + [9, 9]
            cache, n = b.restore(q)
            assert n == len(toks) and cache is not None and matches(cache, q, n)
            assert b.counters.values().remote_refused == 0
    root = Path(tmp_path / "a")
    assert not any(KEY.encode() in p.read_bytes() for p in root.rglob("*") if p.is_file())
    assert all(KEY not in v for v in meta.values())


def test_an_unsigned_entry_is_refused_everywhere(tmp_path: Path, url: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A machine without the key pushes a poisoned prefix (tokens P, KV of other tokens):
    a reader without the key restores the poison; the keyed ones never do, and find the
    signed entry below it."""
    p = tokens_for(2, 5 * T + 3)
    poison = tokens_for(3, 5 * T + 3)
    glen = 4 * T + 1
    with keyed(tmp_path / "a", url) as a:
        good = save_and_push(a, p[:glen])
    with keyless(tmp_path / "x", url) as x:
        bad = save_and_push(x, p, cache_of=poison)
    with keyless(tmp_path / "y", url) as y:  # the attack works on a reader without the key
        cache, n = y.restore(p)
        assert n == len(p) and cache is not None and not matches(cache, p, n)
    caplog.set_level(logging.WARNING, logger="kvstore")
    with keyed(tmp_path / "b", url) as b:
        for q in (p, p + [1], p[: 4 * T]):  # exact, longer, a prefix: never the poison
            want = min(len(q), glen)
            m = b.lookup(q)
            assert m is not None and m.where == "remote" and m.entry_id == good
            assert m.length == want
            cache, n = b.restore(q)
            assert n == want and cache is not None and matches(cache, q, n)
            b.delete(b.lookup(q).entry_id)  # type: ignore[union-attr]  # ask the remote again
        assert b.counters.values().remote_refused == 1
        assert refusals(caplog, bad) == 1  # logged once per entry
    with keyed(tmp_path / "c", url) as c:
        assert [x.digest.hex() for x in c.pull().pulled] == [good]
        named = c.pull([bad])  # asked for by name: reported, not pulled
        assert named.pulled == [] and list(named.failed) == [bad]
        assert "not signed" in named.failed[bad]
        assert [e.id for e in c.entries()] == [good]
        cache, n = c.restore(p)
        assert n == glen and cache is not None and matches(cache, p, n)
    r = Remote(url, signing_key=KEY)
    try:
        refused: list[str] = []
        assert [e.id for e in r.entries(refused=refused)] == [good] and refused == [bad]
        assert r.stats().refused == 1
        rep = r.verify(read_data=True)
        assert rep.refused == [bad] and not rep.sound and rep.bad_manifests == []
    finally:
        r.close()


def test_a_keyed_compaction_or_repair_deletes_nothing_on_an_unsigned_word(
        tmp_path: Path, url: str) -> None:
    """Signed S (2 blocks of its own) and unsigned X (4 blocks of its own): a budget that
    fits S evicts nothing, X's blocks are not swept, X is not dropped; a forged manifest
    claiming S's last block has another size makes verify --repair drop nothing."""
    s_toks, x_toks = tokens_for(4, 2 * T), tokens_for(5, 4 * T)
    with keyed(tmp_path / "a", url) as a:
        s_id = save_and_push(a, s_toks)
    with keyless(tmp_path / "x", url) as x:
        x_id = save_and_push(x, x_toks)
    raw, _ = manifest_of(url, s_id)
    sm = msgspec.msgpack.decode(raw, type=Manifest)
    n2 = 2 * T - 1  # the same blocks, one token fewer: the last block "is" 64 bytes short
    layers = tuple(msgspec.structs.replace(
        lay, offset=n2, tensors=tuple(msgspec.structs.replace(t, shape=(*t.shape[:2], n2,
                                                                       *t.shape[3:]))
                                      for t in lay.tensors)) for lay in sm.layers)
    forged = inject(url, msgspec.structs.replace(sm, n_tokens=n2, tokens=sm.tokens[: 4 * n2],
                                                 layers=layers), tag=None)
    f_id = forged.digest.hex()
    budget = 2 * T * 64  # S's blocks
    plain = Remote(url, signing_key="")
    try:  # without the key, both would delete: the tests below can fail
        assert plain.compact(max_bytes=budget, grace=0, dry_run=True).evicted
        # (issue 29: a keyless repair drops the lying manifest, never the good block)
        plain_ver = plain.verify(repair=True, dry_run=True)
        assert (plain_ver.dropped, plain_ver.deleted_blocks) == ([f_id], 0)
    finally:
        plain.close()
    before = objects(url)
    r = Remote(url, signing_key=KEY)
    try:
        rep = r.compact(max_bytes=budget, grace=0)
        assert (rep.evicted, rep.blocks_deleted, rep.manifests_deleted, rep.markers_deleted
                ) == ([], 0, 0, 0)
        assert rep.refused == sorted([x_id, f_id]) and rep.live_bytes == budget
        assert objects(url) == before
        ver = r.verify(read_data=True, repair=True)
        assert ver.refused == sorted([x_id, f_id]) and ver.wrong_size == []
        assert (ver.dropped, ver.deleted_blocks, ver.deleted_markers) == ([], 0, 0)
        assert objects(url) == before
    finally:
        r.close()
    with keyed(tmp_path / "b", url) as b:  # bit-exact still
        cache, n = b.restore(s_toks)
        assert n == len(s_toks) and cache is not None and matches(cache, s_toks, n)
    with keyless(tmp_path / "y", url) as y:  # and X is whole for a machine without the key
        cache, n = y.restore(x_toks)
        assert n == len(x_toks) and cache is not None and matches(cache, x_toks, n)


def test_a_wrongly_signed_entry_is_refused(tmp_path: Path, url: str) -> None:
    p = tokens_for(6, 3 * T + 1)
    with open_store(tmp_path / "w", remote=url, signing_key=OTHER_KEY) as w:
        bad = save_and_push(w, p, cache_of=tokens_for(7, 3 * T + 1))
    _, meta = manifest_of(url, bad)
    assert meta["kvstore-sig"].startswith("hmac-sha256-v1:")
    with keyed(tmp_path / "a", url) as a:
        good = save_and_push(a, p[: T])
    with keyed(tmp_path / "b", url) as b:
        cache, n = b.restore(p)
        assert n == T and cache is not None and matches(cache, p, n)
        assert b.counters.values().remote_refused == 1
        assert [x.digest.hex() for x in b.pull().pulled] == [good]
    plain = Remote(url, signing_key="")
    try:
        rec = plain.catalog.records(bytes.fromhex(bad))
        assert rec is not None
        theirs = {manifest_key(plain.prefix, rec.digest), *plain.catalog.marker_keys(rec),
                  *(plain.blocks.key(d) for d in rec.blocks)}
    finally:
        plain.close()
    r = Remote(url, signing_key=KEY)
    try:
        assert theirs <= set(objects(url))
        rep = r.compact(max_bytes=0, grace=0)  # a budget of nothing evicts the signed one only
        assert rep.refused == [bad] and rep.evicted == [good]
        ver = r.verify(repair=True)
        assert ver.refused == [bad] and ver.dropped == []
        # what remains is the settings and the refused entry, whole
        assert theirs | {r.prefix + "kvstore.json"} == set(objects(url))
    finally:
        r.close()


def test_a_tampered_signed_manifest_is_refused(tmp_path: Path, url: str) -> None:
    """A signed manifest whose tokens are swapped (the KV of P claimed for Q) keeps the
    signature it had: a reader without the key restores the swap, the keyed ones never."""
    p, q = tokens_for(8, 3 * T), tokens_for(9, 3 * T)
    with keyed(tmp_path / "a", url) as a:
        pid = save_and_push(a, p)
    raw, meta = manifest_of(url, pid)
    sm = msgspec.msgpack.decode(raw, type=Manifest)
    swapped = msgspec.structs.replace(sm, tokens=b"".join(t.to_bytes(4, "little") for t in q))
    rec = inject(url, swapped, tag=meta["kvstore-sig"])
    with keyless(tmp_path / "y", url) as y:
        cache, n = y.restore(q)
        assert n == len(q) and cache is not None and matches(cache, p, n)  # the swap works
    with keyed(tmp_path / "b", url) as b:
        assert b.lookup(q) is None
        cache, n = b.restore(q)
        assert n == 0 and cache is None
        assert b.counters.values().remote_refused == 1
        assert [x.digest.hex() for x in b.pull().pulled] == [pid]
        cache, n = b.restore(p)
        assert n == len(p) and cache is not None and matches(cache, p, n)
    r = Remote(url, signing_key=KEY)
    try:
        before = objects(url)
        ver = r.verify(read_data=True, repair=True)
        assert ver.refused == [rec.digest.hex()] and ver.dropped == []
        assert r.compact(grace=0).refused == [rec.digest.hex()]
        assert objects(url) == before
    finally:
        r.close()


def test_a_signed_entry_replayed_into_another_store_is_refused(tmp_path: Path,
                                                              url: str) -> None:
    """Every object of one prefix copied to another (settings, metadata and all): the
    signature binds the store, so a keyed reader of the copy refuses what it did not sign."""
    toks = tokens_for(10, 2 * T + 3)
    with keyed(tmp_path / "a", url) as a:
        eid = save_and_push(a, toks)
    src = Remote(url, signing_key="")
    other = url.replace("/team/", "/other/")
    s3 = boto3.client("s3")
    try:
        for o in src.client.list(src.prefix):
            s3.copy_object(Bucket=src.url.bucket, Key=o.key.replace("team/", "other/", 1),
                           CopySource={"Bucket": src.url.bucket, "Key": o.key},
                           MetadataDirective="COPY")
    finally:
        src.close()
    _, meta = manifest_of(other, eid)
    assert meta["kvstore-sig"] == expected_tag(url, manifest_of(url, eid)[0])  # copied as is
    with keyed(tmp_path / "b", other) as b:
        cache, n = b.restore(toks)
        assert n == 0 and cache is None
        assert b.counters.values().remote_refused == 1
    with keyless(tmp_path / "c", other) as c:
        cache, n = c.restore(toks)
        assert n == len(toks) and cache is not None and matches(cache, toks, n)


def test_a_keyed_push_signs_its_entry_found_unsigned(tmp_path: Path, url: str) -> None:
    """An entry pushed before the key was set: ``kvstore push`` with the key puts the same
    bytes again, signed, and machines with the key then share it."""
    toks = tokens_for(11, 2 * T + 1)
    with keyless(tmp_path / "a", url) as a:
        eid = save_and_push(a, toks)
    assert "kvstore-sig" not in manifest_of(url, eid)[1]
    with keyed(tmp_path / "a", url, push=False) as a:
        rec = a.local.catalog.records(bytes.fromhex(eid))
        assert rec is not None
        got = a.push(60, everything=True)
        assert (got.entries, got.blocks, got.present, got.failed) == (1, 0, 3, 0)
        assert a.push(60, everything=True).entries == 0  # signed now: nothing to do
    raw, meta = manifest_of(url, eid)
    assert raw == rec.manifest and meta["kvstore-sig"] == expected_tag(url, raw)
    with keyed(tmp_path / "b", url) as b:
        cache, n = b.restore(toks)
        assert n == len(toks) and cache is not None and matches(cache, toks, n)
        assert b.counters.values().remote_refused == 0


def test_a_refusal_stands_a_while_then_the_manifest_is_read_again(
        tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A keyed reader fetches a refused manifest once per ``REFUSED_FOR`` seconds, not once
    per lookup; after that it reads it again, and an entry a machine with the key signed
    meanwhile is then restored."""
    toks = tokens_for(12, 3 * T + 1)
    with keyless(tmp_path / "x", url) as x:
        eid = save_and_push(x, toks)
    with keyed(tmp_path / "b", url) as b:
        cat = b.remote.catalog  # type: ignore[union-attr]
        key = manifest_key(cat.prefix, bytes.fromhex(eid))
        gets: list[str] = []
        real = cat.client.get_with_metadata

        def counted(k: str, **kw: Any) -> tuple[bytes, dict[str, str]]:
            gets.append(k)
            return real(k, **kw)

        monkeypatch.setattr(cat.client, "get_with_metadata", counted)
        for _ in range(3):
            assert b.lookup(toks) is None
        assert gets.count(key) == 1
        with keyed(tmp_path / "x", url, push=False) as x:  # a machine with the key signs it
            assert x.push(60, everything=True).entries == 1
        assert b.lookup(toks) is None and gets.count(key) == 1  # the refusal still stands
        now = time.monotonic()
        monkeypatch.setattr(cat, "clock", lambda: now + catalog_module.REFUSED_FOR + 1)
        m = b.lookup(toks)
        assert m is not None and (m.entry_id, m.where, m.length) == (eid, "remote", len(toks))
        assert gets.count(key) == 2
        cache, n = b.restore(toks)
        assert n == len(toks) and cache is not None and matches(cache, toks, n)
        assert b.counters.values().remote_refused == 1


def test_the_cli_with_a_key_file(tmp_path: Path, url: str) -> None:
    """``$KVSTORE_SIGNING_KEY_FILE``: ``remote ls``, ``stats``, ``verify``, ``compact`` and
    ``pull`` refuse the unsigned entry, say so, and delete nothing because of it."""
    s_toks, x_toks = tokens_for(12, 2 * T), tokens_for(13, 3 * T)
    with keyed(tmp_path / "a", url) as a:
        good = save_and_push(a, s_toks)
    with keyless(tmp_path / "x", url) as x:
        bad = save_and_push(x, x_toks)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_SIGNING")}
    env["KVSTORE_SIGNING_KEY_FILE"] = str(key_file)

    def cli(*args: str, rc: int = 0) -> Any:
        p = subprocess.run([sys.executable, "-m", "kvstore", "--root", str(tmp_path / "c"),
                            "--remote", url, *args, "--json"], capture_output=True,
                           text=True, timeout=120, env=env)
        assert p.returncode == rc, (args, p.stdout, p.stderr)
        return json.loads(p.stdout)

    before = objects(url)
    ls = cli("remote", "ls")
    assert [e["id"] for e in ls["entries"]] == [good] and ls["refused"] == [bad]
    assert cli("remote", "stats")["refused"] == 1
    ver = cli("remote", "verify", "--read-data", rc=1)
    assert ver["refused"] == [bad] and ver["sound"] is False
    ver = cli("remote", "verify", "--repair", rc=1)  # the refused manifest stays: not sound
    assert ver["refused"] == [bad] and ver["dropped"] == [] and ver["deleted_blocks"] == 0
    assert ver["sound_after_repair"] is False
    comp = cli("remote", "compact", "--grace", "0", "--max-bytes", f"{2 * T * 64}B")
    assert comp["refused"] == [bad] and comp["evicted"] == [] and comp["blocks_deleted"] == 0
    assert objects(url) == before
    assert [p["id"] for p in cli("pull")["pulled"]] == [good]
    with keyed(tmp_path / "c", url) as c:
        cache, n = c.restore(s_toks)
        assert n == len(s_toks) and cache is not None and matches(cache, s_toks, n)
        assert [e.id for e in c.entries()] == [good]


def test_a_keyed_push_does_not_sign_what_was_pulled_unsigned(tmp_path: Path, url: str) -> None:
    """The key migration does not launder poison: a machine without the key restores an
    attacker's unsigned entry (it lands in its root, recorded as pulled unsigned), then
    runs ``kvstore push`` with the key: its own save is signed, the pulled entry is not
    (counted); only ``--sign-pulled`` signs it."""
    p, own = tokens_for(14, 3 * T + 1), tokens_for(15, 2 * T + 3)
    with keyless(tmp_path / "x", url) as x:  # the attacker: P's prefix, other KV
        bad = save_and_push(x, p, cache_of=tokens_for(16, 3 * T + 1))
    with keyless(tmp_path / "m", url) as m:
        cache, n = m.restore(p)
        assert n == len(p) and cache is not None and not matches(cache, p, n)
        rec = m.local.catalog.records(bytes.fromhex(bad))
        assert rec is not None and rec.pulled_unsigned
        mine = save_and_push(m, own)
        rec = m.local.catalog.records(bytes.fromhex(mine))
        assert rec is not None and not rec.pulled_unsigned
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_SIGNING")}
    env["KVSTORE_SIGNING_KEY"] = KEY

    def push(*args: str) -> Any:
        p = subprocess.run([sys.executable, "-m", "kvstore", "--root", str(tmp_path / "m"),
                            "--remote", url, "push", *args, "--json"], capture_output=True,
                           text=True, timeout=120, env=env)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        return json.loads(p.stdout)

    st = push()  # the documented migration
    assert (st["entries"], st["pulled_unsigned"], st["failed"]) == (1, 1, 0)
    assert "kvstore-sig" not in manifest_of(url, bad)[1]
    raw, meta = manifest_of(url, mine)
    assert meta["kvstore-sig"] == expected_tag(url, raw)
    with keyed(tmp_path / "b", url) as b:  # a keyed reader still refuses the poison
        assert b.restore(p) == (None, 0)
        assert b.counters.values().remote_refused == 1
        cache, n = b.restore(own)
        assert n == len(own) and cache is not None and matches(cache, own, n)
    st = push()  # again: still not signed, counted again
    assert (st["entries"], st["pulled_unsigned"]) == (0, 1)
    st = push("--sign-pulled")  # told explicitly: signed
    assert (st["entries"], st["pulled_unsigned"], st["failed"]) == (1, 0, 0)
    raw, meta = manifest_of(url, bad)
    assert meta["kvstore-sig"] == expected_tag(url, raw)
    assert push()["pulled_unsigned"] == 0  # signed on the remote now: nothing left to do
