"""Issue 29, item 3 on the real gateway: access records and a GC lease written by anyone with
access to the bucket. What cannot be parsed is ignored and reported; every time value is
bounded. Before, ``inf`` or ``1e300`` was an OverflowError in ``remote compact`` and its
``--dry-run`` (after the deletes, while writing the merged record, with ``1e300``), a string
or a list a ValueError or TypeError, and a lease with ``expires: 1e308`` held every push
back for its whole wait and printed a 300-digit number.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
from cli.cli_helpers import run
from helpers.kv import T, make_cache, open_store, tokens_for

from kvstore.remote import Remote
from kvstore.remote.layout import ACCESS, access_key

HOSTILE_ACCESS = [float("inf"), 1e300, "soon", [1, 2], -5, 1 << 63, True, None]


def _one_entry(tmp_path: Path, url: str) -> str:
    toks = tokens_for(1, 3 * T)
    with open_store(tmp_path / "a", remote=url) as a:
        eid = a.save(toks, make_cache(toks)).id
        assert a.push(60).entries == 1
    return eid


def _access(r: Remote) -> dict[str, bytes]:
    return {o.key: r.client.get(o.key) for o in r.client.list(r.prefix + ACCESS)}


def test_compact_ignores_and_reports_access_records_it_cannot_parse(
    tmp_path: Path, url: str
) -> None:
    eid = _one_entry(tmp_path, url)
    good = int(time.time() * 1000) - 5000
    r = Remote(url)
    try:
        r.client.delete_many(list(_access(r)) or ["-"])
        for v in HOSTILE_ACCESS:  # each its own object, naming the entry
            r.client.put(access_key(r.prefix), msgspec.msgpack.encode({eid: v}))
        r.client.put(access_key(r.prefix), msgspec.msgpack.encode(
            {eid: good, "not hex": good, eid.upper(): good}))
        r.client.put(access_key(r.prefix), msgspec.msgpack.encode([eid, good]))  # no map
        r.client.put(access_key(r.prefix), b"\xc1 not msgpack")
        n_objects = len(HOSTILE_ACCESS) + 3
        ignored = len(HOSTILE_ACCESS) + 2 + 2

        dry = run("--remote", url, "--root", tmp_path / "a", "remote", "compact", "--dry-run")
        assert dry.code == 0 and "Traceback" not in dry.err, dry
        assert f"ignored {ignored} access records that could not be parsed" in dry.err
        assert len(_access(r)) == n_objects  # a dry run writes nothing

        rep = r.compact(dry_run=True)
        assert (rep.access_ignored, rep.access_merged) == (ignored, n_objects)
        wet = run("--remote", url, "--root", tmp_path / "a", "remote", "compact", "--json")
        assert wet.code == 0 and "Traceback" not in wet.err, wet
        out = wet.json()
        assert (out["access_ignored"], out["access_merged"]) == (ignored, n_objects)
        (merged,) = _access(r).values()  # every object merged into one, and only the good
        assert msgspec.msgpack.decode(merged) == {eid: good}
        assert r.read_access() == ({bytes.fromhex(eid): good / 1000}, list(_access(r)), 0)
        assert [e.id for e in r.entries()] == [eid]
    finally:
        r.close()


def test_a_lease_that_claims_to_last_for_ages_is_not_one(tmp_path: Path, url: str) -> None:
    _one_entry(tmp_path, url)
    r = Remote(url)
    try:
        r.client.put(r.lease.key, b'{"token": "t", "owner": "mallory", "expires": 1e308, '
                     b'"margin": 30}', if_absent=False)
        stats = run("--remote", url, "--root", tmp_path / "a", "remote", "stats", "--json")
        assert stats.code == 0 and stats.json()["lease"] == "unreadable lease, expired"
        toks = tokens_for(2, 3 * T)
        with open_store(tmp_path / "b", remote=url) as b:
            b.save(toks, make_cache(toks))
            t0 = time.monotonic()
            st = b.push(60)
            took = time.monotonic() - t0
        assert (st.entries, st.failed) == (1, 0)
        assert took < r.lease.margin, f"the push waited {took:.1f} s on a lying lease"
        rep = r.compact(grace=0)  # takes the lease over, and lets it go
        assert rep.entries == 2 and r.lease.read() is None
        for margin in ("1e308", "-1", "NaN"):
            body = b'{"token": "t", "owner": "m", "expires": 1, "margin": ' + \
                margin.encode() + b"}"
            r.client.put(r.lease.key, body, if_absent=False)
            got = r.lease.read()
            assert got is not None and got.owner == "unreadable lease" and r.lease.stale(got)
    finally:
        r.close()
