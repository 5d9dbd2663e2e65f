"""Issue 29, item 2: every manifest field is bounded and checked against the others by one
validator (``schema.validate_manifest``, called by ``decode_manifest``) before anything is
allocated, read or deleted because of it. The hostile values are the issue's own
reproductions; before the validator each one was a ZeroDivisionError, a MemoryError, a
RecursionError or a run of half an hour.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers.hostile import assert_refused_in_bounded_memory
from helpers.kv import make_cache, open_store, tokens_for

from kvstore.errors import ManifestError
from kvstore.schema import (
    MAX_MANIFEST_BYTES,
    ArraysLayer,
    KVLayer,
    ListLayer,
    Manifest,
    QuantizedLayer,
    RotatingLayer,
    TensorSpec,
    decode_manifest,
    encode_manifest,
)

replace = msgspec.structs.replace


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], bytes, bytes]:
    """A root with one entry of 40 tokens (3 token blocks of 16): its path, tokens, the
    entry's digest and its encoded manifest."""
    root = tmp_path_factory.mktemp("bounds") / "root"
    toks = tokens_for(1, 40)
    with open_store(root) as s:
        info = s.save(toks, make_cache(toks))
        digest = bytes.fromhex(info.id)
        with s.local.index.read() as txn:
            raw = s.local.index.get_manifest(digest, txn)
    assert raw is not None
    return root, toks, digest, raw


def _kv(m: Manifest, **kw: Any) -> Manifest:
    return replace(m, layers=(replace(m.layers[0], **kw),))


def _spec(m: Manifest, i: int, **kw: Any) -> Manifest:
    specs = list(m.layers[0].tensors)
    specs[i] = replace(specs[i], **kw)
    return _kv(m, tensors=tuple(specs))


#: (what is wrong, how to make it from the good manifest, words of the error)
HOSTILE: list[tuple[str, Callable[[Manifest], Manifest], str]] = [
    ("block_tokens 0", lambda m: replace(m, block_tokens=0), "block_tokens 0"),
    ("block_tokens huge", lambda m: replace(m, block_tokens=1 << 40), "block_tokens"),
    ("state_bytes 1e12, state blocks of 1 byte",
     lambda m: replace(m, state_bytes=10**12, state_block_bytes=1), "state_bytes"),
    ("state_block_bytes 0", lambda m: replace(m, state_block_bytes=0), "state_block_bytes 0"),
    ("n_tokens 1e11, blocks of 1 token",
     lambda m: replace(m, n_tokens=10**11, block_tokens=1), "n_tokens"),
    ("n_tokens 0", lambda m: replace(m, n_tokens=0, tokens=b""), "n_tokens 0"),
    ("tokens shorter than n_tokens", lambda m: replace(m, tokens=m.tokens[:-4]), "tokens"),
    ("a missing token block", lambda m: replace(m, token_blocks=m.token_blocks[:-1]),
     "blocks listed"),
    ("an extra state block", lambda m: replace(m, state_blocks=(b"\1" * 32,)),
     "blocks listed"),
    ("a digest of 31 bytes",
     lambda m: replace(m, token_blocks=(*m.token_blocks[:-1], b"\1" * 31)), "digest of 31"),
    ("an unknown dtype", lambda m: _spec(m, 0, dtype="float128"), "unknown dtype"),
    ("a token axis past the shape", lambda m: _spec(m, 0, token_axis=7), "token axis 7"),
    ("a token axis the wrong length",
     lambda m: _spec(m, 0, shape=(1, 2, 20, 8)), "20 tokens on its token axis"),
    ("nine dimensions", lambda m: _spec(m, 0, shape=(1,) * 9), "9 dimensions"),
    ("a tensor of 2**70 bytes",
     lambda m: _spec(m, 0, shape=(1 << 30, 1 << 30, 40, 1 << 10)), "bytes"),
    ("both a token axis and a state offset",
     lambda m: _spec(m, 0, state_offset=0), "both a token axis and a state offset"),
    ("a state tensor at the wrong offset",
     lambda m: replace(m, layers=(*m.layers, ArraysLayer(
         size=1, present=(True,),
         tensors=(TensorSpec(shape=(4,), dtype="float32", state_offset=8),))),
         state_bytes=16, state_blocks=(b"\2" * 32,)), "state offset 8"),
    ("a created_at past year 9999", lambda m: replace(m, created_at=10**18), "created_at"),
    ("quantized bits 0", lambda m: replace(m, layers=(QuantizedLayer(
        offset=40, group_size=64, bits=0, tensors=m.layers[0].tensors),)), "bits 0"),
    ("rotating keep past max_size", lambda m: replace(m, layers=(RotatingLayer(
        offset=40, max_size=4, keep=5, tensors=m.layers[0].tensors),)), "keep 5"),
    ("an offset of 2**40", lambda m: _kv(m, offset=1 << 40), "offset"),
    ("an arrays layer whose size disagrees with its slots", lambda m: replace(
        m, layers=(*m.layers, ArraysLayer(size=3, present=(True,)))), "size 3 with 1 slots"),
    ("list layers nested nine deep", lambda m: replace(m, layers=(_nest(KVLayer(
        offset=40, tensors=m.layers[0].tensors), 9),)), "nested deeper than 8"),
    ("a namespace of 10k chars", lambda m: replace(
        m, namespace=replace(m.namespace, model_id="x" * 10_000)), "namespace.model_id"),
    ("a thousand metadata items",
     lambda m: replace(m, metadata={str(i): "" for i in range(1000)}), "metadata"),
    ("format 4", lambda m: replace(m, format=4), "format 4"),
]


def _nest(layer: Any, depth: int) -> Any:
    for _ in range(depth):
        layer = ListLayer(children=(layer,))
    return layer


def test_the_good_manifest_passes(good: tuple[Path, list[int], bytes, bytes]) -> None:
    m = decode_manifest(good[3])
    assert m.n_tokens == 40 and len(m.token_blocks) == 3
    assert decode_manifest(good[3], hash=m.hash, block_tokens=16) == m


@pytest.mark.parametrize("what,make,words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_each_lie_is_a_manifest_error_with_bounded_memory(
    good: tuple[Path, list[int], bytes, bytes], what: str, make: Callable[[Manifest], Manifest],
    words: str,
) -> None:
    raw = encode_manifest(make(decode_manifest(good[3])))
    assert_refused_in_bounded_memory(raw, words, what)


def test_layers_nested_100k_deep_are_a_manifest_error(
    good: tuple[Path, list[int], bytes, bytes],
) -> None:
    """Hand-made msgpack (msgspec will not encode it): a RecursionError before."""
    enc = msgspec.msgpack.encode
    node = b"\x82" + enc("kind") + enc("list") + enc("children")
    layers = (node + b"\x91") * 100_000 + node + b"\x90"
    fields = msgspec.msgpack.decode(good[3])
    fields.pop("layers")
    head = enc(fields)
    assert head[0] & 0xF0 == 0x80 and len(fields) == head[0] & 0x0F  # a fixmap
    # the same map with one more field (a map16 once it has 16: window_blocks made 15)
    n = len(fields) + 1
    top = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    raw = top + head[1:] + enc("layers") + b"\x91" + layers
    with pytest.raises(ManifestError, match="nested too deep"):
        decode_manifest(raw)


def test_a_manifest_over_the_size_cap_is_refused_unread() -> None:
    with pytest.raises(ManifestError, match=f"at most {MAX_MANIFEST_BYTES}"):
        decode_manifest(b"\0" * (MAX_MANIFEST_BYTES + 1))


def test_settings_of_another_root_are_refused(good: tuple[Path, list[int], bytes, bytes]) -> None:
    with pytest.raises(ManifestError, match="block_tokens 16, this store's is 256"):
        decode_manifest(good[3], block_tokens=256)
    with pytest.raises(ManifestError, match="hash 'blake3', this store's is 'sha256'"):
        decode_manifest(good[3], hash="sha256")


def _put_manifest(root: Path, digest: bytes, raw: bytes) -> None:
    with open_store(root) as s, s.local.index.write() as txn:
        txn.put(digest, raw, db=s.local.index.db("manifests"))


@pytest.mark.parametrize("what", ["block_tokens 0", "state_bytes 1e12, state blocks of 1 byte",
                                  "n_tokens 1e11, blocks of 1 token"])
def test_restore_never_raises_on_a_lying_manifest_in_the_root(
    tmp_path: Path, what: str
) -> None:
    """The entry's manifest record is replaced by a lie: restore is a miss (it raised
    ZeroDivisionError or ran out of memory before), and the other entries still restore."""
    root = tmp_path / "root"
    toks, other = tokens_for(2, 40), tokens_for(3, 40)
    with open_store(root) as s:
        bad = bytes.fromhex(s.save(toks, make_cache(toks)).id)
        s.save(other, make_cache(other))
        with s.local.index.read() as txn:
            raw = s.local.index.get_manifest(bad, txn)
    assert raw is not None
    make = next(h[1] for h in HOSTILE if h[0] == what)
    _put_manifest(root, bad, encode_manifest(make(decode_manifest(raw))))
    with open_store(root) as s:
        cache, n = s.restore(toks)
        assert (cache, n) == (None, 0)
        cache, n = s.restore(other)
        assert n == 40 and cache is not None


def test_a_repair_beside_a_manifest_nested_100k_deep_never_raises(tmp_path: Path) -> None:
    """A restore that finds a corrupt block looks for every entry that needs it, decoding
    only the digest lists of each manifest: a RecursionError there escaped restore()."""
    from helpers.hostile import nested

    root = tmp_path / "root"
    toks = tokens_for(4, 40)
    with open_store(root) as s:
        eid = bytes.fromhex(s.save(toks, make_cache(toks)).id)
        m = s.manifest(eid.hex())
        with s.local.index.read() as txn:
            raw = s.local.index.get_manifest(eid, txn)
        assert raw is not None
        bad = bytes(m.token_blocks[1])
        path = s.local.blocks.path(bad)
    _put_manifest(root, b"\7" * 32, nested(raw))
    path.chmod(0o644)
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with open_store(root) as s:
        cache, n = s.restore(toks, verify=True)
        assert n == 16 and cache is not None  # cut back to the block before the bad one
        assert [p.name[:64] for p in (root / "quarantine").iterdir()] == [bad.hex()]
