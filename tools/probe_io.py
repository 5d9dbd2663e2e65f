"""How many threads each kind of block I/O wants on this machine.

    python tools/probe_io.py [--dir DIR] [--mib 256] [--json FILE]

Times, with 1, 2, 4, 8, 16 and 32 threads over the same block files (16 MiB
blocks, the size of a 256-token block of the benchmark's 16-layer cache):

- reads from the page cache (``preadv`` into preallocated buffers: copies);
- reads after ``POSIX_FADV_DONTNEED`` (the disk's own parallelism: where
  throughput stops growing with threads is the queue depth it serves);
- BLAKE3 of every block, and writing every block to a new file;
- fsync of freshly written files (the durable save's flush round);
- a save's two halves as one pass (hash a 256 KiB chunk, then write it while
  it is in cache) against hashing the whole block and then writing it.

It also prints what the kernel says of the disk (``nr_requests``, the
scheduler, rotational). Nothing here uses kvstore: it measures the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3

BLOCK = 16 << 20
THREADS = (1, 2, 4, 8, 16, 32)
CHUNK = 256 << 10


def _disk_info(path: Path) -> dict[str, str]:
    """What sysfs says of the block device holding ``path`` (Linux; empty elsewhere)."""
    try:
        dev = os.stat(path).st_dev
        sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        disk = sys_dev if (sys_dev / "queue").is_dir() else sys_dev.parent
        out = {"device": disk.name}
        for name in ("nr_requests", "scheduler", "rotational", "max_sectors_kb"):
            f = disk / "queue" / name
            if f.exists():
                out[name] = f.read_text().strip()
        mq = disk / "mq"
        if mq.is_dir():
            out["hw_queues"] = str(len(list(mq.iterdir())))
        return out
    except OSError:
        return {}


def _pool_time(threads: int, jobs: Sequence[Callable[[], None]]) -> float:
    with ThreadPoolExecutor(threads) as pool:
        t = time.perf_counter()
        list(pool.map(lambda f: f(), jobs))
        return time.perf_counter() - t


def _best(fn: Callable[[], float], reps: int) -> float:
    return statistics.median(fn() for _ in range(reps))


def _drop(paths: Sequence[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _write(path: Path, data: memoryview, *, sync: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def probe(base: Path, mib: int, reps: int) -> dict[str, object]:
    n = max(2, (mib << 20) // BLOCK)
    raw = os.urandom(BLOCK)
    blocks = [raw[i:] + raw[:i] for i in range(n)]  # distinct contents
    data = memoryview(raw)
    work = Path(tempfile.mkdtemp(prefix="probe-io-", dir=base))
    files = [work / f"b{i}" for i in range(n)]
    for p, b in zip(files, blocks, strict=True):
        _write(p, memoryview(b))
    os.sync()
    dst = [bytearray(BLOCK) for _ in range(n)]
    fds = [os.open(p, os.O_RDONLY) for p in files]
    gb = n * BLOCK / 1e9
    res: dict[str, dict[int, float]] = {}

    def reads(piece: int) -> list[Callable[[], None]]:
        """One preadv job per ``piece`` bytes of every file (cold reads want many in flight)."""
        jobs: list[Callable[[], None]] = []
        for fd, buf in zip(fds, dst, strict=True):
            mv = memoryview(buf)
            for off in range(0, BLOCK, piece):
                jobs.append(lambda fd=fd, mv=mv, off=off: _read(fd, mv[off : off + piece], off))
        return jobs

    try:
        for t in THREADS:
            res.setdefault("read page cache GB/s", {})[t] = gb / _best(
                lambda t=t: _pool_time(t, reads(BLOCK)), reps)

            def cold(t: int = t) -> float:
                _drop(files)
                return _pool_time(t, reads(1 << 20))

            res.setdefault("read after eviction GB/s (1 MiB preadv)", {})[t] = gb / _best(
                cold, max(1, reps - 1))
            res.setdefault("BLAKE3 GB/s", {})[t] = gb / _best(
                lambda t=t: _pool_time(t, [lambda b=b: blake3.blake3(b).digest()
                                           for b in blocks]), reps)

            def writes(t: int = t) -> float:
                out = [work / f"w{i}" for i in range(n)]
                try:
                    return _pool_time(t, [lambda p=p, b=b: _write(p, memoryview(b))
                                          for p, b in zip(out, blocks, strict=True)])
                finally:
                    for p in out:
                        p.unlink()

            res.setdefault("write page cache GB/s", {})[t] = gb / _best(writes, reps)

            def fsyncs(t: int = t) -> float:
                # 4 MiB files: many of them, so the round has the parallelism to use
                out = [work / f"s{i}" for i in range(4 * n)]
                quarter = data[: BLOCK // 4]
                for p in out:
                    _write(p, quarter)
                try:
                    def sync(p: Path) -> None:
                        fd = os.open(p, os.O_RDONLY)
                        try:
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                    return _pool_time(t, [lambda p=p: sync(p) for p in out])
                finally:
                    for p in out:
                        p.unlink()

            res.setdefault("fsync GB/s (4 MiB files)", {})[t] = gb / _best(fsyncs, max(1, reps - 1))

        cores = os.cpu_count() or 2
        for fused in (False, True):
            def save(fused: bool = fused) -> float:
                out = [work / f"f{i}" for i in range(n)]

                def one(p: Path, b: bytes) -> None:
                    mv = memoryview(b)
                    h = blake3.blake3()
                    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        if fused:
                            for off in range(0, len(mv), CHUNK):
                                h.update(mv[off : off + CHUNK])
                                os.write(fd, mv[off : off + CHUNK])
                        else:
                            h.update(mv)
                            os.write(fd, mv)
                    finally:
                        os.close(fd)
                    h.digest()

                try:
                    return _pool_time(cores, [lambda p=p, b=b: one(p, b)
                                              for p, b in zip(out, blocks, strict=True)])
                finally:
                    for p in out:
                        p.unlink()

            key = "hash+write one pass GB/s" if fused else "hash then write GB/s"
            res[key] = {cores: gb / _best(save, reps)}
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
    return {"cpus": os.cpu_count(), "blocks": n, "block_mib": BLOCK >> 20,
            "loadavg": os.getloadavg(), "disk": _disk_info(base), "results": res}


def _read(fd: int, mv: memoryview, off: int) -> None:
    if os.preadv(fd, [mv], off) != len(mv):
        raise OSError(f"short read at {off}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the scratch files go")
    ap.add_argument("--mib", type=int, default=256, help="bytes of blocks to probe with")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    out = probe(Path(args.dir), args.mib, args.reps)
    print(f"{out['cpus']} CPUs, {out['blocks']} blocks of {out['block_mib']} MiB, "
          f"load {out['loadavg']}, disk {out['disk']}")
    res = out["results"]
    assert isinstance(res, dict)
    width = max(len(k) for k in res)
    print(f"{'':{width}}  " + "".join(f"{t:>8}" for t in THREADS))
    for k, row in res.items():
        print(f"{k:{width}}  " + "".join(
            f"{row[t]:8.2f}" if t in row else f"{'':8}" for t in THREADS))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
