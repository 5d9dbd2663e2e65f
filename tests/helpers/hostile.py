"""Manifests that lie (issue 29): built from a real entry's, so they reuse real block digests.

:func:`halved` is item 1's: every tensor half as wide as the real one, its blocks listed as
they are, so each block it names is good (its bytes hash to its name) and twice the size the
manifest gives it. :func:`publish` puts such a manifest on a remote with its markers, as a
writer with access to the bucket can.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from helpers.kv import matches, sound_store
from kvstore.catalog import keys as P
from kvstore.catalog.records import Records, records_of
from kvstore.schema import Manifest

replace = msgspec.structs.replace


def halved(m: Manifest, tokens: Sequence[int]) -> Manifest:
    """``m`` for ``tokens`` (as many as ``m`` has), each tensor's last axis halved: its
    token blocks are ``m``'s own digests, each claimed at half its real size."""
    assert len(tokens) == m.n_tokens

    def half(layer: Any) -> Any:
        return replace(layer, tensors=tuple(
            replace(t, shape=(*t.shape[:-1], t.shape[-1] // 2)) for t in layer.tensors))

    return replace(m, tokens=P.tokens_le(P.as_tokens(tokens)),
                   layers=tuple(half(x) for x in m.layers))


def publish(remote: Any, m: Manifest) -> Records:
    """Put ``m`` on the remote tier ``remote`` as a finished push would (manifest, markers,
    exact marker), uploading no block: it names blocks that are there."""
    rec = records_of(m)
    assert remote.catalog.commit(rec, lambda digests: None)
    return rec


def nested(raw: bytes, depth: int = 100_000) -> bytes:
    """The encoded manifest ``raw`` with its layers replaced by a list layer nested ``depth``
    deep (hand-made msgpack: msgspec will not encode it)."""
    enc = msgspec.msgpack.encode
    node = b"\x82" + enc("kind") + enc("list") + enc("children")
    layers = (node + b"\x91") * depth + node + b"\x90"
    fields = msgspec.msgpack.decode(raw)
    fields.pop("layers")
    head = enc(fields)
    assert head[0] & 0xF0 == 0x80  # a fixmap: one more field fits
    return bytes([head[0] + 1]) + head[1:] + enc("layers") + b"\x91" + layers


#: Item 2's hostile manifests, by what is wrong with them.
UNBOUNDED = ["block_tokens 0", "state_bytes 1e12", "n_tokens 1e11", "nested 100k deep",
             "200 MB"]


def unbounded(m: Manifest, what: str) -> bytes:
    """The hostile manifest ``what`` (of :data:`UNBOUNDED`) made from ``m``: what a reader
    must refuse unread or after a bounded look, never with a traceback, a MemoryError or
    a run of hours."""
    from kvstore.schema import encode_manifest

    if what == "block_tokens 0":
        return encode_manifest(replace(m, block_tokens=0))
    if what == "state_bytes 1e12":
        return encode_manifest(replace(m, state_bytes=10**12, state_block_bytes=1))
    if what == "n_tokens 1e11":
        return encode_manifest(replace(m, n_tokens=10**11, block_tokens=1))
    if what == "nested 100k deep":
        return nested(encode_manifest(m))
    assert what == "200 MB"
    return encode_manifest(m) + bytes(200 << 20)


def publish_raw(remote: Any, raw: bytes, like: Records) -> bytes:
    """Put ``raw`` on the remote as a manifest named by its digest, with the markers (depth
    and exact) of the entry ``like``, so a lookup of ``like``'s tokens finds it; returns
    its digest."""
    from kvstore.blocks import hash_bytes
    from kvstore.remote.layout import exact_marker, manifest_key, marker_key

    d = hash_bytes(remote.settings.hash, raw)
    p, c = remote.prefix, remote.client
    c.put(manifest_key(p, d), raw)
    for ck in like.depth_keys:
        c.put(marker_key(p, ck, d, like.n_tokens, like.trimmable), b"")
    c.put(exact_marker(p, like.exact_key, d, like.trimmable), b"")
    return d


def assert_refused_in_bounded_memory(raw: bytes, words: str, what: str) -> None:
    """``decode_manifest(raw)`` is a ManifestError saying ``words``, and allocates at most
    about four times the manifest's own bytes on the way (a lie never sizes a buffer)."""
    import tracemalloc

    import pytest

    from kvstore.errors import ManifestError
    from kvstore.schema import decode_manifest

    tracemalloc.start()
    try:
        with pytest.raises(ManifestError) as e:
            decode_manifest(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert words in str(e.value)
    assert peak < 4 * len(raw) + (1 << 20), f"{what}: {peak} bytes allocated"


def assert_nothing_good_lost(store: Any, root: Path, ids: set[str], blocks: set[bytes],
                             good: Sequence[Sequence[int]]) -> None:
    """A lie cost no good data: the root holds exactly the good entries ``ids`` and block
    files ``blocks``, quarantined nothing, restores every good prompt bit for bit, and is
    sound."""
    assert {e.id for e in store.entries()} == ids
    assert {d for d, _ in store.local.block_files()} == blocks
    assert list(root.glob("quarantine/*")) == []
    for t in good:
        cache, n = store.restore(list(t))
        assert n == len(t) and cache is not None and matches(cache, t, n)
    sound_store(store)
