"""Sliding-window layers in token order (issue 26): a ``keep=0`` ``RotatingKVCache`` is
stored unrolled, its rows cut at absolute token positions into window blocks, so the
checkpoints of one prefill share every whole block of their overlapping windows; a
restore rolls the rows back into the very ring mlx-lm had."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
import pytest
from factories import kv_pair, prefilled_rotating_cache, rotating_cache, same_bits
from mlx_lm.models import cache as C

import kvstore
from kvstore.codecs.layout import manifest_blocks
from kvstore.codecs.mlxlm import RotatingCodec
from kvstore.errors import ManifestError
from kvstore.formats.v3 import save_v3
from kvstore.schema import RotatingLayer, WindowLayer

NS = kvstore.Namespace(model_id="window")
T = 16


def _ring_state(c: Any) -> tuple[Any, ...]:
    return (c.offset, c._idx, c.max_size, c.keep, c.keys.shape)


def _same_ring(a: Any, b: Any) -> None:
    """The whole ring buffer, bit for bit, and every field of the ring."""
    assert type(a) is type(b) is C.RotatingKVCache
    assert _ring_state(a) == _ring_state(b)
    assert same_bits(a.keys, b.keys) and same_bits(a.values, b.values)


RINGS = {
    # (cache, tokens it holds, the first token its rows hold)
    "growing": (lambda: rotating_cache(20, 64, 1), 20, 0),
    "wrapped in place": (lambda: rotating_cache(75, 32, 2), 75, 75 - 32),
    # chunks of 20, 20, 20, 10: the last leaves max_size - 1 + 10 rows
    "after a prefill chunk": (lambda: prefilled_rotating_cache(70, 24, 20, 3), 70, 70 - 33),
    "full, not yet wrapped": (lambda: rotating_cache(32, 32, 4), 32, 0),
}


@pytest.mark.parametrize("name", sorted(RINGS))
def test_a_ring_is_stored_in_token_order_and_restored_to_the_same_ring(
    tmp_path: Path, name: str
) -> None:
    build, n, first = RINGS[name]
    ring = build()
    tokens = list(range(500, 500 + n))
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=T) as s:
        info = s.save(tokens, [ring])
        m = s.manifest(info.id)
        (layer,) = m.layers
        assert isinstance(layer, WindowLayer) and layer.idx == ring._idx
        assert [t.window_start for t in layer.tensors] == [first, first]
        assert not m.token_blocks and not m.state_blocks
        assert len(m.window_blocks) == -(-n // T) - first // T
        (got,) = s.load(s.lookup(tokens))
    held = min(ring.offset, ring.keys.shape[2])  # a growing ring's spare rows are not stored
    assert _ring_state(got)[:4] == _ring_state(ring)[:4]
    assert got.keys.shape[2] == held
    assert same_bits(got.keys, ring.keys[..., :held, :])
    assert same_bits(got.values, ring.values[..., :held, :])
    if held == ring.keys.shape[2]:
        _same_ring(got, ring)


def test_rings_it_cannot_roll_back_exactly_are_stored_as_laid_out(tmp_path: Path) -> None:
    kept = rotating_cache(75, 32, 5, keep=4)  # attention-sink rows: not one token range
    short = prefilled_rotating_cache(40, 16, 8, 6)
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=T) as s:
        a = s.manifest(s.save(list(range(75)), [kept]).id)
        # the entry claims fewer tokens than the ring has seen: its rows are not [start, n)
        b = s.manifest(s.save(list(range(30)), [short]).id)
        for m in (a, b):
            assert isinstance(m.layers[0], RotatingLayer) and not m.window_blocks
            assert m.state_blocks


def test_checkpoints_of_one_prefill_share_their_window_blocks(tmp_path: Path) -> None:
    """A checkpoint every 2 blocks adds its 2 new blocks and one partial edge block;
    stored as laid out, each checkpoint's ring would be new bytes from end to end."""
    chunk, window, n = 2 * T, 8 * T, 24 * T
    k, v = kv_pair(n, 7)

    def checkpoints(root: Path) -> list[kvstore.SaveInfo]:
        ring = C.RotatingKVCache(max_size=window, keep=0)
        out = []
        with kvstore.Store.open(root, namespace=NS, block_tokens=T, durable=False) as s:
            for a in range(0, n, chunk):
                ring.update_and_fetch(k[:, :, a : a + chunk], v[:, :, a : a + chunk])
                out.append(s.save(list(range(a + chunk)), [ring]))
        return out

    unrolled = checkpoints(tmp_path / "unrolled")
    with pytest.MonkeyPatch.context() as mp:  # the layout before issue 26, for comparison
        mp.setattr(RotatingCodec, "stored", lambda self, cache, n: self.snapshot(cache))
        ringed = checkpoints(tmp_path / "ringed")
    rows = window - 1 + chunk  # what a ring holds after a prefill chunk
    row_bytes = 2 * 2 * 32 * 2  # K+V, 2 heads, dim 32, bfloat16
    with kvstore.Store.open(tmp_path / "unrolled", create=False) as s:
        ms = [s.manifest(i.id) for i in unrolled]
    full = window // chunk + 1  # from this checkpoint on the window has slid
    for before, after in zip(ms[full:], ms[full + 1 :], strict=False):
        new = set(after.window_blocks) - set(before.window_blocks)
        assert len(new) == chunk // T + 1  # the new tokens' blocks and the partial edge block
    for info in unrolled[full + 1 :]:
        assert info.new_bytes <= (chunk + T) * row_bytes
    for info in ringed[full + 1 :]:
        assert info.new_bytes == rows * row_bytes  # the whole ring, every time
    assert sum(i.new_bytes for i in unrolled) < sum(i.new_bytes for i in ringed) / 3


def test_entries_stored_as_rings_before_still_restore_bit_exactly(tmp_path: Path) -> None:
    ring = rotating_cache(75, 32, 8)
    root = tmp_path / "root"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RotatingCodec, "stored", lambda self, cache, n: self.snapshot(cache))
        with kvstore.Store.open(root, namespace=NS, block_tokens=T) as s:
            eid = s.save(list(range(75)), [ring]).id
    with kvstore.Store.open(root, create=False) as s:
        assert isinstance(s.manifest(eid).layers[0], RotatingLayer)
        (got,) = s.load(s.lookup(list(range(75)), namespace=NS))
    _same_ring(got, ring)


@pytest.mark.parametrize("name", sorted(RINGS))
def test_export_of_a_window_entry_is_the_file_of_the_ring(tmp_path: Path, name: str) -> None:
    """mlx-bun files hold the ring as laid out: exporting an entry stored in token order
    writes the same bytes as writing the original cache."""
    build, n, _ = RINGS[name]
    ring = build()
    tokens = list(range(900, 900 + n))
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=T) as s:
        info = s.save(tokens, [ring])
        m = s.manifest(info.id)
        assert isinstance(m.layers[0], WindowLayer)
        s.export(info.id, tmp_path / "store.kv")
    save_v3(tmp_path / "direct.kv", tokens, [ring], namespace=NS, created_at=m.created_at,
            metadata={})
    assert (tmp_path / "store.kv").read_bytes() == (tmp_path / "direct.kv").read_bytes()


def test_window_specs_that_lie_are_a_manifest_error(tmp_path: Path) -> None:
    ring = rotating_cache(75, 32, 9)
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=T) as s:
        m = s.manifest(s.save(list(range(75)), [ring]).id)
    manifest_blocks(m)  # sound
    layer = m.layers[0]
    spec = layer.tensors[0]

    def with_spec(**fields: Any) -> Any:
        bad = msgspec.structs.replace(spec, **fields)
        return msgspec.structs.replace(
            m, layers=(msgspec.structs.replace(layer, tensors=(bad, layer.tensors[1])),)
        )

    for fields in ({"window_start": 44}, {"window_start": 75}, {"token_axis": None},
                   {"shape": (1, 2, 33, 32)}):
        with pytest.raises(ManifestError):
            manifest_blocks(with_spec(**fields))
    with pytest.raises(ManifestError, match="window"):
        manifest_blocks(msgspec.structs.replace(m, window_blocks=m.window_blocks[:-1]))


def test_restored_window_layer_decodes_like_the_original(tmp_path: Path) -> None:
    """Keys and values fed after a restore meet the same ring as in memory."""
    ring = prefilled_rotating_cache(70, 24, 20, 10)
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=T) as s:
        s.save(list(range(70)), [ring])
        (got,) = s.load(s.lookup(list(range(70))))
    k, v = kv_pair(5, 11)
    for i in range(5):
        a = ring.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        b = got.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert all(same_bits(x, y) for x, y in zip(a, b, strict=True))
    _same_ring(got, ring)
    mx.eval(got.keys)
