"""Which S3 client: boto3 (kvstore's ``S3Client``, tuned pool) vs obstore, same gateway.

Both clients talk to the bucket named by ``--bucket`` at ``$AWS_ENDPOINT_URL`` with the
standard ``AWS_*`` credentials. Cases, run side by side (A B B A rounds):

- small GET latency: p50/p99 of sequential 1 KiB GETs (a lookup's manifest reads);
- small LIST latency: p50 of a LIST of 16 keys (a lookup's marker bisection step);
- PUT and GET throughput of 1 MiB objects with N threads (blocks; kvstore pushes and
  pulls with 16).

obstore is not a dependency of kvstore: ``pip install obstore`` to run this.

    python tools/bench_s3_client.py --bucket NAME [--objects 64] [--threads 16] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore.remote.s3 import S3Client


class Boto:
    name = "boto3"

    def __init__(self, bucket: str, threads: int) -> None:
        self.c = S3Client(bucket, max_pool_connections=threads + 8)

    def put(self, key: str, body: bytes) -> None:
        self.c.put(key, body, if_absent=False)

    def get(self, key: str) -> bytes:
        return self.c.get(key)

    def list16(self, prefix: str) -> int:
        return len(list(self.c.list(prefix, limit=16)))

    def close(self) -> None:
        self.c.close()


class Obstore:
    name = "obstore"

    def __init__(self, bucket: str, threads: int) -> None:
        import obstore
        from obstore.store import S3Store

        self.o = obstore
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        self.s = S3Store(
            bucket,
            endpoint=endpoint,
            region=os.environ.get("AWS_REGION", "us-east-1"),
            access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
            secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
            virtual_hosted_style_request=False,
            client_options={"allow_http": True, "pool_max_idle_per_host": str(threads + 8)},
        )

    def put(self, key: str, body: bytes) -> None:
        self.o.put(self.s, key, body)

    def get(self, key: str) -> bytes:
        return bytes(self.o.get(self.s, key).bytes())

    def list16(self, prefix: str) -> int:
        n = 0
        for batch in self.o.list(self.s, prefix, chunk_size=16):
            n += len(batch)
            break
        return n

    def close(self) -> None:
        pass


def _rounds(clients: list[Any], reps: int, fn: Callable[[Any], float]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {c.name: [] for c in clients}
    for r in range(reps + 1):
        order = clients if r % 2 == 0 else clients[::-1]
        for c in order:
            dt = fn(c)
            if r:  # round 0 warms up
                out[c.name].append(dt)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bucket", required=True)
    p.add_argument("--objects", type=int, default=64, help="1 MiB objects per throughput rep")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    run = f"client-bench-{uuid.uuid4().hex[:8]}/"
    clients: list[Any] = [Boto(a.bucket, a.threads), Obstore(a.bucket, a.threads)]
    pool = ThreadPoolExecutor(a.threads)
    small, big = os.urandom(1024), os.urandom(1 << 20)
    res: dict[str, Any] = {"threads": a.threads, "objects": a.objects}
    try:
        for i in range(16):
            clients[0].put(f"{run}small/{i:02d}", small)

        def get_small(c: Any) -> float:
            lat = []
            for i in range(100):
                t = time.perf_counter()
                assert c.get(f"{run}small/{i % 16:02d}") == small
                lat.append(time.perf_counter() - t)
            return statistics.median(lat)

        def list_small(c: Any) -> float:
            lat = []
            for _ in range(50):
                t = time.perf_counter()
                assert c.list16(f"{run}small/") == 16
                lat.append(time.perf_counter() - t)
            return statistics.median(lat)

        def put_big(c: Any) -> float:
            t = time.perf_counter()
            list(pool.map(lambda i: c.put(f"{run}big-{c.name}/{i}", big), range(a.objects)))
            return a.objects * len(big) / (time.perf_counter() - t) / 1e6

        def get_big(c: Any) -> float:
            t = time.perf_counter()
            got = list(pool.map(lambda i: c.get(f"{run}big-{c.name}/{i}"), range(a.objects)))
            assert all(g == big for g in got)
            return a.objects * len(big) / (time.perf_counter() - t) / 1e6

        cases = [("GET 1 KiB p50 (ms)", get_small, 1e3), ("LIST 16 keys p50 (ms)", list_small, 1e3),
                 (f"PUT 1 MiB x{a.threads} (MB/s)", put_big, 1.0),
                 (f"GET 1 MiB x{a.threads} (MB/s)", get_big, 1.0)]
        for label, fn, scale in cases:
            got = _rounds(clients, a.reps, fn)
            res[label] = {k: statistics.median(v) * scale for k, v in got.items()}
            line = "  ".join(f"{k} {v:8.2f}" for k, v in res[label].items())
            print(f"{label:<28} {line}", flush=True)
    finally:
        pool.shutdown()
        keys = [o.key for o in clients[0].c.list(run)]
        if keys:
            clients[0].c.delete_many(keys)
        for c in clients:
            c.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
