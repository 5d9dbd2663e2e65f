"""Deterministic tiny KV caches (B1 H2 D8) whose rows depend on their token only.

Equal token prefixes give equal rows (as a causal model does), so entries share
blocks, and any process can rebuild the exact tensors a restore must return.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from factories import prefix_cache, token_rows

import kvstore
from kvstore.schema import decode_manifest

NS = kvstore.Namespace(model_id="tiny-gc", config_fingerprint="cfg", tokenizer_hash="tok")
H, D = 2, 8
T = 16  # block_tokens of every test root


def rows(tokens: Sequence[int], salt: int) -> mx.array:
    """[1, H, len, D] float16 integers < 2039 (exact in fp16), a function of each token."""
    return token_rows(tokens, salt, heads=H, dim=D, dtype=mx.float16)


def make_cache(tokens: Sequence[int]) -> list[Any]:
    return [prefix_cache(tokens, mx.float16, heads=H, dim=D)]


def hybrid_cache(tokens: Sequence[int]) -> list[Any]:
    """A cache that cannot be trimmed: attention rows that follow the tokens, and an
    SSM-like state of 16 KiB, its own at each depth of each conversation."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    kv = KVCache()
    t = mx.array(list(tokens), dtype=mx.float32).reshape(1, 1, len(tokens), 1)
    k = mx.broadcast_to(t, (1, 2, len(tokens), 8))
    kv.update_and_fetch(k, -k)
    ssm = ArraysCache(1)
    ssm[0] = mx.full((1, 64, 64), float(tokens[0] * 10000 + len(tokens)))
    return [kv, ssm]


def matches(cache: list[Any], tokens: Sequence[int], length: int) -> bool:
    """True when ``cache`` holds exactly the rows of ``tokens[:length]``."""
    if len(cache) != 1:
        return False
    c = cache[0]
    k, v = c.keys, c.values
    if k is None or v is None:
        return False
    if c.offset != length or k.shape[2] < length:
        return False
    want = tokens[:length]
    return bool(
        mx.array_equal(k[:, :, :length], rows(want, 0)).item()
        and mx.array_equal(v[:, :, :length], rows(want, 1000)).item()
    )


def tokens_for(seed: int, n: int, shared: int = 0) -> list[int]:
    """``shared`` tokens common to every seed, then ``n - shared`` seed-specific ones."""
    r = random.Random(seed)
    return list(range(1, shared + 1)) + [r.randrange(1, 30000) for _ in range(n - shared)]


def open_store(root: Path | str, **kw: Any) -> kvstore.Store:
    return kvstore.Store.open(root, namespace=NS, block_tokens=T, durable=False, **kw)


def open_built(root: Path | str, built: dict[str, Any], **kw: Any) -> kvstore.Store:
    """:func:`open_store`, the store built with ``built`` in its options too
    (``StoreOptions`` fields ``Store.open`` has no keyword for: ``clock``, ``push_retry``):
    a store is built whole, never changed after construction."""
    from dataclasses import replace

    from kvstore.store.opening import StoreOptions

    class Built(kvstore.Store):
        def __init__(self, local: Any, options: StoreOptions, **parts: Any) -> None:
            super().__init__(local, replace(options, **built), **parts)

    return Built.open(root, namespace=NS, block_tokens=T, durable=False, **kw)


WORKER = Path(__file__).resolve().parent / "worker.py"


def run_worker(
    cmd: str, args: dict[str, Any], *, crash_at: str | None = None, timeout: float = 120.0
) -> tuple[int, dict[str, Any] | None, str]:
    """Run ``worker.py cmd`` to completion: (return code, its JSON output or None, stderr)."""
    proc = start_worker(cmd, args, crash_at=crash_at)
    out, err = proc.communicate(timeout=timeout)
    line = out.strip().splitlines()[-1] if out.strip() else ""
    return proc.returncode, (json.loads(line) if line else None), err


def start_worker(cmd: str, args: dict[str, Any], *, crash_at: str | None = None) -> Any:
    env = dict(os.environ)
    env.pop("KVSTORE_CRASH_AT", None)
    if crash_at:
        env["KVSTORE_CRASH_AT"] = crash_at
    return subprocess.Popen(
        [sys.executable, str(WORKER), cmd, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def recount(s: kvstore.Store) -> dict[bytes, int]:
    """References per block, counted from the manifests themselves (one per manifest)."""
    counts: dict[bytes, int] = {}
    with s.local.index.read() as txn:
        for _, raw in s.local.index.iter_manifests(txn):
            m = decode_manifest(raw)
            for d in dict.fromkeys((*m.token_blocks, *m.state_blocks)):
                counts[d] = counts.get(d, 0) + 1
    return counts


def sound_store(s: kvstore.Store, *, read_data: bool = True) -> None:
    """Assert verify passes and no manifest references a missing block."""
    r = s.verify(read_data=read_data)
    assert r.sound, r
    with s.local.index.read() as txn:
        for _, raw in s.local.index.iter_manifests(txn):
            m = decode_manifest(raw)
            for d in (*m.token_blocks, *m.state_blocks):
                assert s.local.blocks.exists(d), f"manifest references missing block {d.hex()}"


def two_layer_kv(tokens: Sequence[int]) -> list[Any]:
    """A two-layer mlx-lm KVCache whose rows are a function of their token (and layer)
    alone, evaluated: what a prompt cache is handed by the server."""
    from mlx_lm.models.cache import KVCache

    layers = []
    for layer in range(2):
        c = KVCache()
        t = mx.array(list(tokens), dtype=mx.float32).reshape(1, 1, len(tokens), 1)
        k = mx.broadcast_to(t * (layer + 1), (1, 2, len(tokens), 8))
        c.update_and_fetch(k, -k)
        layers.append(c)
    mx.eval([c.state for c in layers])
    return layers


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
