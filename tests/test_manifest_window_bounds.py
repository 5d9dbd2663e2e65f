"""Issue 26 on issue 29's validator: a window layer (a ``keep=0`` RotatingKVCache stored in
token order, cut at absolute token positions) has its own row count, and
``schema.validate_manifest`` checks it exactly: its keys and values hold the tokens
``[window_start, n_tokens)``, at least ``min(n_tokens, max_size)`` of them, with the ring
position mlx-lm can have for that many rows; its window blocks are counted from the
block its window starts in. A manifest that lies about any of it is refused before
anything is read, and a window tensor anywhere else (a KV layer dodging the ``n_tokens``
rule, an attachment) is refused too: no bound of another layer kind is loosened.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from factories import kv_cache, prefilled_rotating_cache, rotating_cache
from helpers.hostile import assert_refused_in_bounded_memory
from helpers.kv import T, open_store

from kvstore.errors import ManifestError
from kvstore.schema import (
    Attachment,
    KVLayer,
    ListLayer,
    Manifest,
    TensorSpec,
    WindowLayer,
    decode_manifest,
    encode_manifest,
)

replace = msgspec.structs.replace

#: (name, the cache, its tokens, the first token its window holds, ring position)
RINGS: dict[str, tuple[Callable[[], list[Any]], int, int, int]] = {
    "growing": (lambda: [rotating_cache(20, 64, 1)], 20, 0, 20),
    "wrapped": (lambda: [rotating_cache(75, 32, 2)], 75, 75 - 32, 11),
    # chunks of 20: the last leaves max_size - 1 + 10 rows, in token order
    "after a prefill chunk": (lambda: [prefilled_rotating_cache(70, 24, 20, 3)], 70, 70 - 33,
                              33),
    "beside a KV layer": (lambda: [kv_cache(75, 4), rotating_cache(75, 32, 5)], 75, 75 - 32,
                          11),
}


@pytest.fixture(scope="module")
def rings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The encoded manifest of each ring, saved by a store as it saves any cache."""
    root = tmp_path_factory.mktemp("window-bounds") / "root"
    out = {}
    with open_store(root) as s:
        for i, (name, (build, n, _, _)) in enumerate(RINGS.items()):
            toks = list(range(1000 * i + 1, 1000 * i + n + 1))  # an entry of its own each
            digest = bytes.fromhex(s.save(toks, build()).id)
            with s.local.index.read() as txn:
                raw = s.local.index.get_manifest(digest, txn)
            assert raw is not None
            out[name] = bytes(raw)
    return out


@pytest.mark.parametrize("name", list(RINGS))
def test_window_entries_as_a_store_saves_them_pass(rings: dict[str, bytes], name: str) -> None:
    _, n, start, idx = RINGS[name]
    m = decode_manifest(rings[name], block_tokens=T)
    w = m.layers[-1]
    assert isinstance(w, WindowLayer) and (w.offset, w.idx) == (n, idx)
    assert [t.window_start for t in w.tensors] == [start, start]
    assert all(t.shape[2] == n - start for t in w.tensors)
    # window blocks from the absolute block the window starts in, to the entry's end
    assert len(m.window_blocks) == -(-n // T) - start // T


def _window(m: Manifest, **kw: Any) -> Manifest:
    return replace(m, layers=(*m.layers[:-1], replace(m.layers[-1], **kw)))


def _specs(m: Manifest, **kw: Any) -> Manifest:
    """Both window tensors changed alike (a consistent lie, not a mismatched pair)."""
    return _window(m, tensors=tuple(replace(t, **kw) for t in m.layers[-1].tensors))


def _rows(m: Manifest, rows: int) -> Manifest:
    """Keys and values that hold the last ``rows`` tokens, with the ring position and
    window blocks that would go with them: only the rule about rows can refuse it."""
    n = m.n_tokens
    out = _specs(m, window_start=n - rows,
                 shape=(*m.layers[-1].tensors[0].shape[:2], rows,
                        m.layers[-1].tensors[0].shape[3]))
    blocks = -(-n // T) - (n - rows) // T
    return _window(replace(out, window_blocks=(b"\1" * 32,) * blocks), idx=rows)


def _kv_with_window_start(m: Manifest) -> Manifest:
    """The KV layer's tensors claim a window start: they would dodge the n_tokens rule."""
    kv = m.layers[0]
    assert isinstance(kv, KVLayer)
    return replace(m, layers=(replace(kv, tensors=tuple(
        replace(t, window_start=5, shape=(*t.shape[:2], m.n_tokens - 5, t.shape[3]))
        for t in kv.tensors)), *m.layers[1:]))


#: (what is wrong, the ring it is made from, how, words of the error)
HOSTILE: list[tuple[str, str, Callable[[Manifest], Manifest], str]] = [
    ("fewer rows than the window", "wrapped", lambda m: _rows(m, 31),
     "a window of 31 rows, max_size 32 needs 32"),
    ("fewer rows than the tokens of a ring that never wrapped", "growing",
     lambda m: _rows(m, 19), "a window of 19 rows, max_size 64 needs 20"),
    ("more rows than the entry's tokens", "wrapped",
     lambda m: _specs(m, shape=(1, 2, 80, 32)), "does not hold tokens [43, 75)"),
    ("a window from past the entry's end", "wrapped", lambda m: _specs(m, window_start=75),
     "window from token 75 of 75"),
    ("keys and values from two starts", "wrapped", lambda m: _window(m, tensors=(
        m.layers[-1].tensors[0], replace(m.layers[-1].tensors[1], window_start=40))),
     "not window tensors from one token"),
    ("a window tensor without a token axis", "wrapped", lambda m: _specs(m, token_axis=None),
     "not window tensors from one token"),
    ("three tensors", "wrapped", lambda m: _window(m, tensors=(*m.layers[-1].tensors,
                                                              m.layers[-1].tensors[0])),
     "3 tensors, a window layer has keys and values"),
    ("an offset that is not the entry's end", "wrapped", lambda m: _window(m, offset=74),
     "window layer at offset 74, the entry has 75"),
    ("a ring position past its rows", "after a prefill chunk", lambda m: _window(m, idx=40),
     "ring position 40 with 33 rows"),
    ("a wrapped ring with more rows than max_size", "after a prefill chunk",
     lambda m: _window(m, idx=5), "ring position 5 with 33 rows of max_size 24"),
    ("a wrapped ring position 0", "wrapped", lambda m: _window(m, idx=0),
     "ring position 0 with 32 rows"),
    ("max_size 0", "wrapped", lambda m: _window(m, max_size=0), "max_size 0"),
    ("max_size 2**40", "wrapped", lambda m: _window(m, max_size=1 << 40), "max_size"),
    ("a missing window block", "wrapped",
     lambda m: replace(m, window_blocks=m.window_blocks[:-1]), "blocks listed"),
    ("window blocks counted from token 0", "wrapped",
     lambda m: replace(m, window_blocks=(b"\1" * 32,) * 5), "0+5+0 token+window+state"),
    ("window blocks without a window", "growing",
     lambda m: replace(m, layers=(KVLayer(offset=20, tensors=tuple(
         replace(t, window_start=None) for t in m.layers[-1].tensors)),)),
     "blocks listed"),
    ("a window digest of 31 bytes", "wrapped",
     lambda m: replace(m, window_blocks=(*m.window_blocks[:-1], b"\1" * 31)), "digest of 31"),
    ("a KV layer's tensors with a window start", "beside a KV layer", _kv_with_window_start,
     "a window tensor outside a window layer"),
    ("a window tensor in a list layer's KV child", "beside a KV layer",
     lambda m: replace(m, layers=(ListLayer(children=(_kv_with_window_start(m).layers[0],)),
                                  m.layers[1])), "a window tensor outside a window layer"),
    ("an attachment with a window tensor", "wrapped", lambda m: replace(
        m, attachments=(Attachment(schema="x", tensors=(TensorSpec(
            shape=(4, 2), dtype="float32", token_axis=0, window_start=71),)),)),
     "attachments[0]: a window tensor outside a window layer"),
    ("a window layer inside a list layer that lies", "wrapped",
     lambda m: replace(m, layers=(ListLayer(children=(replace(m.layers[0], idx=3 * 32),)),)),
     "layers[0].children[0]: ring position 96"),
]


@pytest.mark.parametrize("what,ring,make,words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_each_window_lie_is_a_manifest_error_with_bounded_memory(
    rings: dict[str, bytes], what: str, ring: str, make: Callable[[Manifest], Manifest],
    words: str,
) -> None:
    raw = encode_manifest(make(decode_manifest(rings[ring])))
    assert_refused_in_bounded_memory(raw, words, what)


def test_the_kv_rule_is_unchanged_beside_a_window(rings: dict[str, bytes]) -> None:
    """The KV layer of a window entry still needs exactly n_tokens rows."""
    m = decode_manifest(rings["beside a KV layer"])
    kv = m.layers[0]
    short = replace(m, layers=(replace(kv, tensors=tuple(
        replace(t, shape=(*t.shape[:2], 74, t.shape[3])) for t in kv.tensors)), m.layers[1]))
    with pytest.raises(ManifestError, match="74 tokens on its token axis, the entry has 75"):
        decode_manifest(encode_manifest(short))


def test_restore_never_raises_on_a_lying_window_manifest(tmp_path: Path) -> None:
    """The entry's manifest record is replaced by a window lie: restore is a miss, and the
    other entries still restore. (An entry that cannot be trimmed is judged by its exact
    key, which reads its manifest: the lie raised out of the lookup before.)"""
    root = tmp_path / "root"
    toks, other = list(range(1, 76)), list(range(100, 175))
    with open_store(root) as s:
        bad = bytes.fromhex(s.save(toks, [rotating_cache(75, 32, 6)]).id)
        s.save(other, [rotating_cache(75, 32, 7)])
        with s.local.index.read() as txn:
            raw = s.local.index.get_manifest(bad, txn)
        assert raw is not None
        lie = encode_manifest(_rows(decode_manifest(raw), 20))
        with s.local.index.write() as txn:
            txn.put(bad, lie, db=s.local.index.db("manifests"))
    with open_store(root) as s:
        assert s.restore(toks) == (None, 0)
        cache, n = s.restore(other)
        assert n == 75 and cache is not None and cache[0].offset == 75
