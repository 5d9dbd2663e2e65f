"""Faults against the real gateway: the gateway killed during a push and during a
restore, bad credentials and a missing bucket, and a kill at every crash point of the
remote protocol (and of the local one, with a remote configured)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.kv import T, make_cache, matches, open_store, run_worker, sound_store, tokens_for

import kvstore
from kvstore._crash import REMOTE_POINTS
from kvstore.remote import Remote
from kvstore.remote.errors import RemoteAuthError, RemoteNotFoundError

ROOT = Path(__file__).resolve().parents[2]


def rgw(action: str, rgw_dir: str) -> None:
    subprocess.run(["bash", str(ROOT / "tools" / "ceph-rgw.sh"), action, rgw_dir], check=True,
                   timeout=120, capture_output=True)


@pytest.fixture
def gateway(rgw_dir: str) -> Iterator[Any]:
    """``kill()`` the gateway in the test; it is always running again afterwards."""
    state = {"down": False}

    class G:
        def kill(self) -> None:
            rgw("kill-rgw", rgw_dir)
            state["down"] = True

        def start(self) -> None:
            rgw("start-rgw", rgw_dir)
            state["down"] = False

    try:
        yield G()
    finally:
        if state["down"]:
            rgw("start-rgw", rgw_dir)


def visible_entries_sound(url: str) -> Any:
    r = Remote(url)
    try:
        rep = r.verify(read_data=True)
        assert rep.sound, rep
        return rep
    finally:
        r.close()


def restore_all(root: Path, url: str, specs: list[tuple[int, int, int]]) -> int:
    """Restore every spec on ``root`` from the remote, each hit bit-exact (a shorter one
    too: a prefix another entry shares); how many restored whole."""
    whole = 0
    with open_store(root, remote=url) as s:
        for spec in specs:
            q = tokens_for(*spec)
            cache, n = s.restore(q)
            if cache is not None:
                assert matches(cache, q, n)
                whole += n == len(q)
    return whole


def test_gateway_killed_in_the_middle_of_a_push(tmp_path: Path, url: str, gateway: Any) -> None:
    specs = [(seed, 24 * T, 4 * T) for seed in range(60)]
    with open_store(tmp_path / "a", remote=url, push=False) as a:
        for spec in specs:
            t = tokens_for(*spec)
            a.save(t, make_cache(t))
        assert a.remote is not None
        exact = a.remote.prefix + "exact/"
        out: dict[str, Any] = {}
        th = threading.Thread(target=lambda: out.update(st=a.push(120, everything=True)))
        th.start()
        deadline = time.monotonic() + 60
        while sum(1 for _ in a.remote.client.list(exact)) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        gateway.kill()
        th.join(120)
        assert not th.is_alive()
        st = out["st"]
        assert st.failed > 0 and st.entries < len(specs), st  # it says so
        t0 = time.monotonic()
        t = tokens_for(999, 5 * T)
        assert a.save(t, make_cache(t)).created  # local saves keep working
        assert time.monotonic() - t0 < 10
        gateway.start()
        again = a.push(120, everything=True)
        assert again.failed == 0 and again.entries == len(specs) + 1 - st.entries, again
    visible_entries_sound(url)  # nothing partial is visible
    assert restore_all(tmp_path / "b", url, specs) == len(specs)


def test_gateway_down_during_restore(tmp_path: Path, url: str, gateway: Any) -> None:
    short, long = (7, 4 * T, 0), (7, 12 * T, 0)
    with open_store(tmp_path / "a", remote=url) as a:
        for spec in (short, long):
            t = tokens_for(*spec)
            a.save(t, make_cache(t))
        a.push(60)
    with open_store(tmp_path / "b", remote=url, remote_timeout=2.0) as b:
        q = tokens_for(*short)
        cache, n = b.restore(q)  # pulled: now local
        assert n == len(q)
        gateway.kill()
        q = tokens_for(*long)
        t0 = time.monotonic()
        cache, n = b.restore(q)  # the remote has 12 blocks; the local root 4
        took = time.monotonic() - t0
        assert cache is not None and n == 4 * T and matches(cache, q, n)
        assert took < 2.0 * 3, took
        t0 = time.monotonic()
        cache, n = b.restore(q)  # the remote is left alone for a while: no wait at all
        assert n == 4 * T and time.monotonic() - t0 < 1.0
    with open_store(tmp_path / "c", remote=url, remote_timeout=2.0) as c:
        t0 = time.monotonic()
        assert c.restore(tokens_for(*long)) == (None, 0)  # a miss, not an exception
        assert time.monotonic() - t0 < 2.0 * 3


def test_bad_credentials_and_a_missing_bucket(tmp_path: Path, url: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RemoteNotFoundError, match="bucket does not exist"):
        open_store(tmp_path / "a", remote="s3://kvstore-no-such-bucket/x")
    env = {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    with monkeypatch.context() as m:
        m.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        with pytest.raises(RemoteAuthError, match="credentials refused"):
            open_store(tmp_path / "a", remote=url)
    open_store(tmp_path / "r").close()
    for args, extra, want in (
        (["--remote", "s3://kvstore-no-such-bucket/x", "push"], {}, "bucket does not exist"),
        (["--remote", url, "push"], env, "credentials refused"),
        (["--remote", url, "remote", "stats"], env, "credentials refused"),
        (["--remote", "http://x/y", "remote", "ls"], {}, "not an s3:// URL"),
    ):
        p = subprocess.run([sys.executable, "-m", "kvstore", "--root", str(tmp_path / "r"),
                            *args], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **extra})
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvstore: error: ") and want in lines[0]


SPEC = (5, 10 * T, 2 * T)


@pytest.mark.parametrize("point", [p for p in REMOTE_POINTS if p.startswith("push_")])
def test_crash_in_a_push(tmp_path: Path, url: str, point: str) -> None:
    rc, out, err = run_worker("remote-save", {"root": str(tmp_path / "a"), "remote": url,
                                              "seeds": [SPEC[0]], "n": SPEC[1],
                                              "shared": SPEC[2]}, crash_at=point)
    assert rc == -9, f"not killed at {point}: {rc} {out} {err}"
    rep = visible_entries_sound(url)
    assert rep.incomplete  # the push did not finish
    q = tokens_for(*SPEC)
    with open_store(tmp_path / "b", remote=url) as b:
        m = b.lookup(q)
        if point == "push_before_exact":  # blocks and depth markers are there: it serves
            assert m is not None and m.where == "remote" and m.length == len(q)
        else:
            assert m is None  # nothing of it is visible
    with open_store(tmp_path / "a", remote=url) as a:  # a later push completes it
        st = a.push(60, everything=True)
        assert st.entries == 1 and st.failed == 0
        sound_store(a)
    rep = visible_entries_sound(url)
    assert not rep.incomplete and rep.entries == 1
    assert restore_all(tmp_path / "c", url, [SPEC]) == 1


@pytest.mark.parametrize("point", [p for p in REMOTE_POINTS if p.startswith("remote_gc")])
def test_crash_in_a_remote_compaction(tmp_path: Path, url: str, point: str) -> None:
    specs = [(s, 6 * T, 2 * T) for s in range(6)]
    with open_store(tmp_path / "a", remote=url) as a:
        for spec in specs:
            t = tokens_for(*spec)
            a.save(t, make_cache(t))
            a.push(60)
    rc, out, err = run_worker("remote-compact", {"remote": url, "max_bytes": 8 * T * 64,
                                                 "lease": 4.0, "margin": 1.0}, crash_at=point)
    assert rc == -9, f"not killed at {point}: {rc} {out} {err}"
    r = Remote(url, lease_seconds=4.0, lease_margin=1.0)
    try:
        assert r.stats().lease is not None  # the killed compaction's lease stays...
        late = (50, 6 * T, 2 * T)  # ...a push waits for it to go stale, then goes on
        t0 = time.monotonic()
        with open_store(tmp_path / "w", remote=url) as w:
            t = tokens_for(*late)
            w.save(t, make_cache(t))
            assert w.push(60).failed == 0
        assert time.monotonic() - t0 < 30
        visible_entries_sound(url)
        rep = r.compact(max_bytes=8 * T * 64, grace=0)  # the next compaction finishes the job
        assert rep.live_bytes <= 8 * T * 64
        assert r.stats().lease is None
        left = [e for e in r.entries() if e.complete]
    finally:
        r.close()
    visible_entries_sound(url)
    assert left
    assert restore_all(tmp_path / "c", url, [*specs, late]) >= len(left)


# --- the local crash points, with a remote configured ------------------------------------

sys.path.insert(0, str(ROOT / "tests"))
import test_crash as local  # noqa: E402


@pytest.mark.parametrize(("point", "op", "prep", "want"), local.CASES,
                         ids=[f"{c[1]}-{c[0]}-{'-'.join(c[2]) or 'plain'}" for c in local.CASES])
def test_local_crash_points_hold_with_a_remote(
    tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch, point: str, op: str,
    prep: dict[str, bool], want: dict[str, bool],
) -> None:
    """The local crash matrix, the killed process having the remote attached (the test's
    own checks look at the local root, as in tests/test_crash.py); then everything pushes
    and the remote verifies."""
    monkeypatch.setenv("KVSTORE_REMOTE", url)  # the worker's store attaches it
    monkeypatch.setattr(local, "open_store", lambda root, **kw: open_store(root, remote="", **kw))
    local.test_crash(tmp_path, point, op, prep, want)
    with open_store(tmp_path / "r", remote=url) as s:
        assert s.push(60, everything=True).failed == 0
    visible_entries_sound(url)
    _ = kvstore
