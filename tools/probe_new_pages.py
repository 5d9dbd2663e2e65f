"""Writing into new page-cache pages vs into pages just freed, same buffer, same run.

A store keeps the files it writes, so each save needs pages the page cache has
not held before; a baseline that rewrites one file in place refills the pages
its old file just gave back. On a virtual machine whose host takes back idle
memory, the first kind of write can cost several times the second. This probe
shows whether the machine it runs on does that, before a benchmark is read.

Usage: python tools/probe_new_pages.py [--mib 140] [--files 8] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def _write(path: str, data: memoryview) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    """Print the median time of each kind of write and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=140, help="size of each write (default 140)")
    ap.add_argument("--files", type=int, default=8, help="writes of each kind (default 8)")
    ap.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = ap.parse_args()
    data = memoryview(os.urandom(args.mib << 20))
    scratch = tempfile.mkdtemp(prefix="probe-", dir=args.dir)
    kept: list[float] = []
    recycled: list[float] = []
    try:
        rewritten = os.path.join(scratch, "rewritten")
        _write(rewritten, data)
        for i in range(args.files):  # A B A B: the kinds share the machine's noise
            kept.append(_write(os.path.join(scratch, f"kept-{i}"), data))
            # O_TRUNC frees the old file's pages and the write refills them
            recycled.append(_write(rewritten, data))
            time.sleep(0.2)
    finally:
        shutil.rmtree(scratch)
    k, r = statistics.median(kept), statistics.median(recycled)
    print(f"{args.mib} MiB into new pages (a new file, kept):      {k * 1e3:8.1f} ms median")
    print(f"{args.mib} MiB into freed pages (one file rewritten): {r * 1e3:8.1f} ms median")
    print(f"ratio new/freed: {k / r:.2f}x")


if __name__ == "__main__":
    main()
