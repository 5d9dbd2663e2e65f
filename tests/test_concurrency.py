"""Many processes on one root: fork, concurrent saves, GC racing saves and readers,
a full index map, a full disk, network filesystems, and a soak (slow)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.kv import (
    make_cache,
    matches,
    open_store,
    recount,
    sound_store,
    start_worker,
    tokens_for,
)

import kvstore
import kvstore.local.filesystem
from kvstore.errors import StoreFullError
from kvstore.local.errors import UnsupportedFilesystemError


def _lock_holders(lockfile: Path) -> set[int]:
    """Pids holding a POSIX lock on ``lockfile`` (from /proc/locks)."""
    ino = os.stat(lockfile).st_ino
    pids = set()
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            # "1: POSIX  ADVISORY  READ 1234 08:01:5678 0 EOF" (a "->" marks a waiter)
            if "->" in parts:
                continue
            dev_ino = parts[5].split(":")
            if len(dev_ino) == 3 and int(dev_ino[2]) == ino:
                pids.add(int(parts[4]))
    return pids


def test_fork_reopens_the_environment(tmp_path: Path) -> None:
    root = tmp_path / "r"
    s = open_store(root)
    parent_toks = tokens_for(1, 64)
    s.save(parent_toks, make_cache(parent_toks))
    child_toks = tokens_for(2, 64)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only the index, no MLX (its threads do not survive fork)
        code = 1
        try:
            os.close(r)
            import gc

            assert s.lookup(parent_toks) is not None
            assert s.lookup(child_toks) is None
            with s.local.index.write() as txn:  # a write through the child's own environment
                txn.put(b"child-was-here", b"1", db=s.local.index.db("meta"))
            gc.collect()  # the inherited environment must not be closed by this
            ok = os.getpid() in _lock_holders(root / "index" / "lock.mdb")
            os.write(w, b"ok" if ok else b"no lock")
            code = 0
        except BaseException as e:  # report it to the parent
            os.write(w, repr(e).encode()[:500])
        finally:
            os._exit(code)
    os.close(w)
    msg = os.read(r, 1000)
    _, status = os.waitpid(pid, 0)
    assert status == 0 and msg == b"ok", msg
    assert s.local.index.get_meta(b"child-was-here") == b"1"
    s.save(child_toks, make_cache(child_toks))  # the parent's environment still works
    cache, n = s.restore(child_toks)
    assert cache is not None and matches(cache, child_toks, n)
    sound_store(s)
    s.close()


def test_concurrent_saves_of_one_prefix_store_each_block_once(tmp_path: Path) -> None:
    root = tmp_path / "r"
    open_store(root).close()
    start = time.time() + 2.0
    procs = [
        start_worker(
            "save", {"root": str(root), "seed": 10 + i, "n": 200, "shared": 160, "start_at": start}
        )
        for i in range(4)
    ]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    with open_store(root) as s:
        assert s.stats().entries == 4
        with s.local.index.read() as txn:
            refs = dict(s.local.index.iter_refs(txn))
        assert sum(1 for r in refs.values() if r.refcount == 4) == 10  # 160 tokens, T=16
        assert sorted(s.local.blocks) == sorted(refs)  # one file per distinct block
        assert s.stats().physical_bytes == sum(r.size for r in refs.values())
        sound_store(s)


def test_saves_succeed_while_another_process_compacts_with_grace_0(tmp_path: Path) -> None:
    root = tmp_path / "r"
    s = open_store(root)
    gc_proc = start_worker("loop-compact", {"root": str(root), "until": time.time() + 4.0})
    saved: list[list[int]] = []
    deadline = time.time() + 3.5
    i = 0
    while time.time() < deadline:
        t = tokens_for(i % 5, 60 + 10 * (i % 5), shared=48)
        s.save(t, make_cache(t))  # never fails, even when its blocks are at refcount zero
        saved.append(t)
        cache, n = s.restore(t, verify=True)
        assert cache is not None and n == len(t) and matches(cache, t, n)
        m = s.lookup(t)
        assert m is not None
        s.delete(m.entry_id)  # back to refcount zero: the GC may take the blocks
        i += 1
    out, err = gc_proc.communicate(timeout=60)
    assert gc_proc.returncode == 0, err
    assert i > 10
    sound_store(s)
    s.close()


def test_a_reader_racing_evict_and_compact_gets_exact_data_or_a_miss(tmp_path: Path) -> None:
    root = tmp_path / "r"
    s = open_store(root)
    seeds = [1, 2, 3]
    spec = {"n": 120, "shared": 48}
    reader = start_worker("reader", {"root": str(root), "seconds": 4.0, "seeds": seeds, **spec})
    assert reader.stdout.readline().strip() == "ready"
    deadline = time.time() + 3.5
    rounds = 0
    while time.time() < deadline:
        for seed in seeds:
            t = tokens_for(seed, spec["n"], spec["shared"])
            s.save(t, make_cache(t))
        s.compact(max_bytes=0, grace=0)  # evict everything, unlink the blocks at once
        rounds += 1
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    import json

    res = json.loads(out.strip().splitlines()[-1])
    assert res["violations"] == 0, res
    assert res["hits"] + res["misses"] > 0 and rounds > 5
    sound_store(s)
    s.close()


def test_network_filesystems_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "r"
    mounts = f"server:/export {tmp_path} nfs4 rw,relatime 0 0\n"
    real_open = open

    def fake_open(path: object, *a: object, **kw: object) -> object:
        if path == "/proc/mounts":
            return io.StringIO("/dev/sda1 / ext4 rw 0 0\n" + mounts)
        return real_open(path, *a, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(kvstore.local.filesystem, "open", fake_open, raising=False)
    assert kvstore.local.filesystem.filesystem_type(root) == "nfs4"
    with pytest.raises(UnsupportedFilesystemError, match="nfs4"):
        open_store(root)


def test_a_full_index_map_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "r"
    s = open_store(root, map_size=192 << 10)
    saved: list[list[int]] = []
    with pytest.raises(StoreFullError, match="map is full"):
        for i in range(2000):
            t = tokens_for(i, 600)
            s.save(t, make_cache(t))
            saved.append(t)
    assert len(saved) > 0
    assert s.stats().entries == len(saved)  # the failed save left nothing
    sound_store(s)
    for t in saved[:3]:
        cache, n = s.restore(t)
        assert cache is not None and matches(cache, t, n)
    s.compact(max_bytes=0, grace=0)  # freeing room makes saving work again
    t = tokens_for(5000, 600)
    s.save(t, make_cache(t))
    assert s.lookup(t) is not None
    s.close()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (needs root and mount); skipped where one cannot be made."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip(reason="the full-disk test requires the mount command (for a small fs)")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(reason=f"the full-disk test requires a 2 MiB tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_fails_the_save_cleanly(small_fs: Path) -> None:
    root = small_fs / "r"
    s = open_store(root)
    saved: list[list[int]] = []
    with pytest.raises(StoreFullError):
        for i in range(5000):
            t = tokens_for(i, 500)
            s.save(t, make_cache(t))
            saved.append(t)
    assert saved
    assert s.stats().entries == len(saved)  # nothing partial is visible
    r = s.verify(read_data=True)
    assert r.sound, r
    for t in saved[-3:]:
        cache, n = s.restore(t, verify=True)
        assert cache is not None and n == len(t) and matches(cache, t, n)
    s.compact(max_bytes=s.stats().physical_bytes // 2, grace=0)  # free space
    t = tokens_for(9999, 500)
    s.save(t, make_cache(t))
    cache, n = s.restore(t, verify=True)
    assert cache is not None and matches(cache, t, n)
    sound_store(s)
    s.close()


@pytest.mark.slow
def test_soak_many_processes_small_budget(tmp_path: Path) -> None:
    import json

    root = tmp_path / "r"
    budget = 96 << 10
    open_store(root).close()
    procs = [
        start_worker(
            "soak", {"root": str(root), "worker": w, "seconds": 22.0, "seeds": 40,
                     "budget": budget}
        )
        for w in range(7)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    total = {k: sum(r[k] for r in results) for k in results[0]}
    print("soak:", total)
    assert total["violations"] == 0, total
    assert total["errors"] == 0, total
    assert total["saves"] > 100 and total["hits"] > 100 and total["compacts"] > 10
    with open_store(root) as s:
        r = s.verify(read_data=True)
        assert r.sound, r
        with s.local.index.read() as txn:
            stored = {d: ref.refcount for d, ref in s.local.index.iter_refs(txn) if ref.refcount}
        assert stored == recount(s)
        assert s.stats().physical_bytes <= budget
        sound_store(s)
