"""The remote tier against a raw client: push and pull-restore throughput vs PUT and GET
of the same bytes with the same client and concurrency, and time to first token on a
second machine that restores from the remote vs prefill (``kvstore bench --remote URL``).

Each rep works under a fresh prefix of the URL (``bench-<random>/``), deleted after.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..remote import Remote
from ..remote.s3 import S3Client, parse_s3_url
from ..schema import Namespace
from ..store import Store
from .common import Config, Row, interleave, make_cache, median
from .io_cases import NS, _label, tokens_for

WORKERS = 16  # the remote's request threads (kvstore.remote.tier.DEFAULT_WORKERS)


def _sub(url: str) -> str:
    u = parse_s3_url(url)
    return f"s3://{u.bucket}/{u.prefix}bench-{uuid.uuid4().hex[:12]}/"


def _wipe(url: str) -> None:
    u = parse_s3_url(url)
    c = S3Client(u.bucket)
    try:
        c.delete_prefix(u.prefix)
    finally:
        c.close()


def _block_bytes(root: Path) -> list[bytes]:
    with Store.open(root) as s:
        return [s.local.blocks.get(d, verify=False) for d in s.local.blocks.iter()]


def remote_rows(cfg: Config, scratch: Path, url: str) -> list[Row]:
    n = cfg.sizes[0]
    cache = make_cache(cfg, n, seed=n)
    toks = tokens_for(n, seed=n)
    src = Path(tempfile.mkdtemp(prefix="remote-src-", dir=scratch))
    with Store.open(src, namespace=NS) as s:
        s.save(toks, cache)
    blocks = _block_bytes(src)
    nbytes = sum(len(b) for b in blocks)
    u = parse_s3_url(url)
    client = S3Client(u.bucket, max_pool_connections=WORKERS + 8)
    pool = ThreadPoolExecutor(WORKERS)
    subs: list[str] = []
    state: dict[str, str] = {}

    def push() -> float:
        if "last" in state:  # one copy at a time: a test gateway's store is small
            _wipe(state["last"])
        sub = _sub(url)
        subs.append(sub)
        with Store.open(src, namespace=NS, remote=sub, push=False) as s:
            t = time.perf_counter()
            st = s.push(everything=True)
            dt = time.perf_counter() - t
        assert st.entries == 1 and st.failed == 0, st
        state["last"] = sub
        return dt

    def raw_put() -> float:
        if "raw" in state:
            _wipe(f"s3://{u.bucket}/{state['raw']}")
        prefix = parse_s3_url(_sub(url)).prefix
        subs.append(f"s3://{u.bucket}/{prefix}")
        t = time.perf_counter()
        list(pool.map(lambda ib: client.put(f"{prefix}{ib[0]}", ib[1]), enumerate(blocks)))
        dt = time.perf_counter() - t
        state["raw"] = prefix
        return dt

    def pull() -> float:
        root = Path(tempfile.mkdtemp(prefix="remote-dst-", dir=scratch))
        try:
            with Store.open(root, namespace=NS, remote=state["last"], push=False) as s:
                t = time.perf_counter()
                c, length = s.restore(toks)
                mx.eval([x.state for x in c or []])
                dt = time.perf_counter() - t
            assert c is not None and length == n
            return dt
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def raw_get() -> float:
        prefix = state["raw"]
        t = time.perf_counter()
        got = list(pool.map(lambda i: client.get(f"{prefix}{i}"), range(len(blocks))))
        dt = time.perf_counter() - t
        assert sum(len(g) for g in got) == nbytes
        return dt

    try:
        res = interleave({"push": push, "put": raw_put}, cfg.reps)
        pulls = interleave({"pull": pull, "get": raw_get}, cfg.reps)
        rows = [
            Row("remote", f"push {_label(n)} tokens ({len(blocks)} blocks)", "MB/s",
                nbytes / median(res["push"]) / 1e6, nbytes / median(res["put"]) / 1e6,
                f"raw PUT, same client, {WORKERS} threads", "throughput",
                extra={"bytes": float(nbytes)}),
            Row("remote", f"pull-restore {_label(n)} tokens (empty root)", "MB/s",
                nbytes / median(pulls["pull"]) / 1e6, nbytes / median(pulls["get"]) / 1e6,
                f"raw GET, same client, {WORKERS} threads", "throughput",
                extra={"bytes": float(nbytes)}),
        ]
        rows += _ttft_rows(cfg, scratch, url)
        return rows
    finally:
        pool.shutdown()
        client.close()
        for sub in subs:
            _wipe(sub)
        shutil.rmtree(src, ignore_errors=True)


def _ttft_rows(cfg: Config, scratch: Path, url: str) -> list[Row]:
    """Machine A saves and pushes a prompt's cache; machine B (an empty root) restores it
    from the remote and decodes one token, vs B prefilling the prompt itself."""
    from mlx_lm.models.cache import make_prompt_cache

    from .index_cases import _prefill, _tiny_model

    model, label = _tiny_model(cfg, scratch)
    vocab = int(model.args.vocab_size)
    ns = Namespace(model_id="kvstore-bench-tiny-llama")
    n = cfg.ttft_sizes[-1]  # the target is at 4k tokens
    tokens = [int(t) for t in np.random.default_rng(n).integers(4, vocab, n)]
    sub = _sub(url)
    a_root = Path(tempfile.mkdtemp(prefix="ttft-a-", dir=scratch))
    try:
        with Store.open(a_root, namespace=ns, remote=sub) as a:
            cache = make_prompt_cache(model)
            model(mx.array(tokens[:-1])[None], cache=cache)
            mx.eval([c.state for c in cache])
            a.save(tokens[:-1], cache)
            assert a.push().failed == 0
        want = _prefill(model, tokens)

        def remote_restore() -> float:
            root = Path(tempfile.mkdtemp(prefix="ttft-b-", dir=scratch))
            try:
                with Store.open(root, namespace=ns, remote=sub, push=False) as b:
                    t = time.perf_counter()
                    c, length = b.restore(tokens)
                    assert c is not None and length == n - 1
                    y = mx.argmax(model(mx.array(tokens[length:])[None], cache=c)[:, -1, :],
                                  axis=-1)
                    mx.eval(y)
                    dt = time.perf_counter() - t
                assert y.item() == want.item(), "the pulled cache gave another token"
                return dt
            finally:
                shutil.rmtree(root, ignore_errors=True)

        def prefill() -> float:
            t = time.perf_counter()
            _prefill(model, tokens)
            return time.perf_counter() - t

        res = interleave({"kv": remote_restore, "pf": prefill}, cfg.ttft_reps)
        return [Row("remote", f"time to first token on a second machine, {n} tokens ({label})",
                    "s", median(res["kv"]), median(res["pf"]), "prefill from scratch",
                    "speedup")]
    finally:
        shutil.rmtree(a_root, ignore_errors=True)
        _wipe(sub)


def reachable(url: str) -> str | None:
    """None when ``url`` answers, else why not (one line)."""
    try:
        r = Remote(url, timeout=3.0)
        try:
            r.client.check_bucket()
        finally:
            r.close()
    except Exception as e:  # noqa: BLE001 - any failure means: skip the group, say why
        return str(e)
    return None


__all__: list[str] = ["reachable", "remote_rows"]
