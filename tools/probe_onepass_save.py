"""Would a save gain from hashing and writing each block in one pass over its bytes?

    python tools/probe_onepass_save.py [TOKENS]

Takes the real block pieces of the benchmark's cache (``kvstore.local.writer.place``)
and, on kvstore's own I/O pool, times writing every block to a new file two ways, in
alternating rounds: as a save does today (BLAKE3 of the whole block, then ``writev``),
and in one pass (each 256 KiB piece hashed, then written while it is in cache). Prints
the medians in ms. Nothing here changes kvstore.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore.bench.common import QUICK, make_cache
from kvstore.blocks import new_hasher
from kvstore.blocks.pools import io_pool
from kvstore.codecs import snapshot
from kvstore.local.writer import place

CHUNK = 256 << 10


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 4096
    cache = make_cache(QUICK, n, seed=7)
    _, bs = place([snapshot(c) for c in cache], n, 256, 1 << 20)
    blocks = bs.token_pieces + bs.state_pieces
    d = Path(tempfile.mkdtemp(prefix="probe-onepass-"))
    names = iter(range(1 << 30))

    def new_file() -> int:
        return os.open(f"{d}/{next(names)}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def two_pass(pieces: Sequence[memoryview]) -> None:
        h = new_hasher("blake3")
        for p in pieces:
            h.update(p)
        h.digest()
        fd = new_file()
        try:
            os.writev(fd, pieces)
        finally:
            os.close(fd)

    def one_pass(pieces: Sequence[memoryview]) -> None:
        h = new_hasher("blake3")
        fd = new_file()
        try:
            for p in pieces:
                b = memoryview(p).cast("B")
                for o in range(0, len(b), CHUNK):
                    c = b[o : o + CHUNK]
                    h.update(c)
                    os.write(fd, c)
        finally:
            os.close(fd)
        h.digest()

    def timed(fn: Callable[[Sequence[memoryview]], None]) -> float:
        t = time.perf_counter()
        list(io_pool().map(fn, blocks))
        dt = time.perf_counter() - t
        for f in os.listdir(d):
            os.unlink(f"{d}/{f}")
        return dt

    got: dict[str, list[float]] = {"hash, then write": [], "one pass": []}
    try:
        for r in range(8):
            order = [("hash, then write", two_pass), ("one pass", one_pass)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                dt = timed(fn)
                if r:
                    got[name].append(dt)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    size = sum(len(p) for b in blocks for p in b)
    print(f"{n} tokens, {len(blocks)} blocks, {size >> 20} MiB, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}")
    for name, v in got.items():
        print(f"  {name:<18} {statistics.median(v) * 1e3:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
