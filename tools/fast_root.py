"""Build large roots fast, for tools/scaling.py: a 1M-entry index, roots of 10k-1M blocks.

A ``Store.save`` of a tiny entry costs ~1.7 ms here (MLX evaluation, a block
file, its own LMDB commit), so 1M entries would take half an hour. These
builders skip MLX: each entry's manifest is made from a template that a real
save produced (only its tokens, shapes and block digests change), and it is
committed through the root's catalog with the records a save derives
(``records_of``: the chain, the exact key, the prefix values), 20k commits
sharing one LMDB write transaction. So the index holds exactly what saves would
have put there; the lookups and compactions timed against it run kvstore's own
code on it.

- :class:`LookupIndexBuilder`: entries of one of 64 system prompts (256-512
  tokens) plus 16-128 tokens of their own; block files are not written (a
  lookup never opens them).
- :func:`build_compact_root`: entries of ``blocks_per_entry`` blocks each (16-token
  blocks, so manifests stay small), every block a real file named by the
  digest of its (64-byte) contents.

Uses kvstore internals (kvstore.catalog.records, the root's catalog, kvstore.schema): a
tool, not an API.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import mlx.core as mx
import msgspec
import numpy as np
from mlx_lm.models.cache import KVCache

from kvstore import Namespace, Store
from kvstore.catalog.records import records_of
from kvstore.local import now_ms
from kvstore.schema import Manifest, encode_manifest

VOCAB = 32000


def _template(store: Store, ns: Namespace, block_tokens: int) -> Manifest:
    """The manifest of a real one-layer (B1 H1 D8 bfloat16) KVCache entry."""
    c = KVCache()
    kv = mx.zeros((1, 1, block_tokens + 1, 8), dtype=mx.bfloat16)
    c.update_and_fetch(kv, kv)
    mx.eval(c.keys, c.values)
    info = store.save(list(range(block_tokens + 1)), [c], namespace=ns)
    m = store.manifest(info.id)
    store.delete(info.id)
    return m


class _Committer:
    """Commits synthetic entries of the template's layout, as ``Store.save`` would."""

    def __init__(self, store: Store, ns: Namespace) -> None:
        self.store = store
        self.ns = ns
        self.T = store.block_tokens
        self.tmpl = _template(store, ns, self.T)
        self._txn: Any = None
        self._pending = 0
        self._outer: Any = None

    @contextlib.contextmanager
    def batched(self, every: int = 20_000) -> Iterator[None]:
        """Let ``every`` commits share one write transaction (``Index.write`` yields it)."""
        index = self.store.local.index
        orig = index.write

        @contextlib.contextmanager
        def shared() -> Iterator[Any]:
            if self._txn is None:
                self._outer = orig()
                self._txn = self._outer.__enter__()
            yield self._txn
            self._pending += 1
            if self._pending >= every:
                self._flush()

        setattr(index, "write", shared)  # noqa: B010 - this instance only
        try:
            yield
        finally:
            self._flush()
            delattr(index, "write")

    def _flush(self) -> None:
        if self._outer is not None:
            self._outer.__exit__(None, None, None)
        self._outer = self._txn = None
        self._pending = 0

    def commit(self, toks: np.ndarray, token_blocks: Sequence[bytes]) -> bytes:
        """Commit one entry of these tokens and token blocks (the template's 32 bytes a
        token: the block sizes records_of derives)."""
        n = len(toks)
        tok_le = toks.astype("<u4").tobytes()
        layer = self.tmpl.layers[0]
        specs = tuple(msgspec.structs.replace(s, shape=(1, 1, n, 8)) for s in layer.tensors)
        m = msgspec.structs.replace(
            self.tmpl, created_at=now_ms(), n_tokens=n, tokens=tok_le,
            layers=(msgspec.structs.replace(layer, tensors=specs),),
            token_blocks=tuple(token_blocks), state_blocks=())
        encoded = encode_manifest(m)
        digest = blake3.blake3(encoded).digest()
        rec = records_of(m, encoded, digest, priority=0, last_access=m.created_at)
        self.store.local.catalog.commit(rec, lambda ds: None)  # the blocks are the caller's
        return digest


class LookupIndexBuilder:
    """A root whose index grows to ``n`` entries sharing 64 system prompts."""

    def __init__(self, root: Path, ns: Namespace) -> None:
        self.rng = np.random.default_rng(1234)
        self.store = Store.open(root, namespace=ns, durable=False, map_size=16 << 30)
        self.c = _Committer(self.store, ns)
        self.prompts = [self.rng.integers(0, VOCAB, int(n), dtype=np.uint32)
                        for n in self.rng.choice([256, 512], 64)]
        self.entries: list[np.ndarray] = []

    def grow_to(self, n: int) -> None:
        T = self.c.T
        with self.c.batched():
            self._grow(n, T)

    def _grow(self, n: int, T: int) -> None:
        while len(self.entries) < n:
            p = self.prompts[int(self.rng.integers(len(self.prompts)))]
            toks = np.concatenate([p, self.rng.integers(0, VOCAB, int(self.rng.integers(16, 129)),
                                                        dtype=np.uint32)])
            # one digest per token block; they are never read (a lookup opens no block)
            nb = -(-len(toks) // T)
            blocks = [blake3.blake3(toks[i * T : (i + 1) * T].tobytes()).digest()
                      for i in range(nb)]
            self.c.commit(toks, blocks)
            self.entries.append(toks)

    def queries(self, count: int, length: int) -> list[tuple[np.ndarray, int]]:
        """Queries of ``length`` tokens extending stored entries, with the match they must find."""
        out = []
        for _ in range(count):
            e = self.entries[int(self.rng.integers(len(self.entries)))]
            tail = self.rng.integers(0, VOCAB, max(0, length - len(e)), dtype=np.uint32)
            out.append((np.concatenate([e, tail])[:length], min(len(e), length)))
        return out

    def close(self) -> None:
        self.store.close()


def _write_files(root: Path, items: Sequence[tuple[bytes, bytes]], threads: int = 32) -> None:
    """Write each (digest, contents) as its block file, many at once.

    File creation on the virtual disk here costs 0.1-2 ms (it varies with the
    other work on the machine) but overlaps well, so 32 threads create them.
    """
    def one(chunk: Sequence[tuple[bytes, bytes]]) -> None:
        for d, data in chunk:
            hx = d.hex()
            fd = os.open(f"{root}/blocks/{hx[:2]}/{hx}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                         0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    step = max(1, len(items) // (threads * 4))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, [items[i : i + step] for i in range(0, len(items), step)]))


def build_compact_root(root: Path, ns: Namespace, *, blocks: int,
                       blocks_per_entry: int) -> list[str]:
    """A root of ``blocks`` block files (512 bytes each) in entries of ``blocks_per_entry``.

    Returns the entry ids. Every block is a real file named by the digest of
    its contents, written before the entries that reference it are committed
    (as a save does).
    """
    rng = np.random.default_rng(blocks)
    store = Store.open(root, namespace=ns, durable=False, map_size=16 << 30, block_tokens=16)
    ids: list[str] = []
    try:
        c = _Committer(store, ns)
        T = c.T
        for fan in range(256):
            os.makedirs(f"{store.root}/blocks/{fan:02x}", exist_ok=True)
        made = 0
        with c.batched():
            while made < blocks:
                # a chunk at a time: its files, then its entries
                chunk: list[tuple[np.ndarray, list[bytes]]] = []
                files: list[tuple[bytes, bytes]] = []
                while made < blocks and len(files) < 50_000:
                    k = min(blocks_per_entry, blocks - made)
                    digests = []
                    for _ in range(k):
                        data = rng.bytes(512)
                        d = blake3.blake3(data).digest()
                        files.append((d, data))
                        digests.append(d)
                    chunk.append((rng.integers(0, VOCAB, k * T, dtype=np.uint32), digests))
                    made += k
                _write_files(store.root, files)
                for toks, digests in chunk:
                    ids.append(c.commit(toks, digests).hex())
    finally:
        store.close()
    return ids
