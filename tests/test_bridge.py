"""The store bridge: mlx-bun files imported as entries and exported back, losslessly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from factories import (
    arrays_cache,
    kv_cache,
    prefix_cache,
    quantized_cache,
    rotating_cache,
    same_bits,
    state_arrays,
)
from mlx_lm.models import cache as _cache

import kvstore
from kvstore.codecs import RawCache
from kvstore.errors import NamespaceRequiredError
from kvstore.formats.errors import FileFormatError, HeaderHashMismatchError, TensorHashMismatchError
from kvstore.formats.v3 import PREFIX_LEN, Loaded, load_v3, save_v3
from kvstore.store.bridge import (
    BLOCK_BYTES_KEY,
    CREATED_AT_KEY,
    FORMAT_VERSION_KEY,
    IDENTITY_KEY,
)

SAMPLES = Path(__file__).resolve().parent / "data" / "mlx-bun-v3"
V3_SAMPLES = ["tiny", "kv-plain", "mixed", "with-attachments"]
C: Any = _cache  # mlx-lm ships no type hints
NS = kvstore.Namespace(model_id="tiny", config_fingerprint="cfg", tokenizer_hash="tok")


def _open(root: Path, **kw: Any) -> kvstore.Store:
    return kvstore.Store.open(root, durable=False, block_tokens=kw.pop("block_tokens", 64), **kw)


def _sample(name: str) -> Path:
    path = SAMPLES / f"{name}.kv"
    assert path.is_file(), f"test vector missing: {path}"
    return path


def _stored(loaded: Loaded) -> list[mx.array]:
    """Every tensor of a file as mlx-bun stored it (KV rows cut back to the offset)."""
    out: list[mx.array] = []
    for layer, entry in zip(loaded.cache, loaded.header["caches"], strict=True):
        if isinstance(layer, RawCache):
            out.extend(layer.tensors)
        elif isinstance(layer, C.ArraysCache):
            out.extend(a for a in layer.cache if a is not None)
        elif isinstance(layer, C.RotatingKVCache):
            out.extend([layer.keys, layer.values])
        elif isinstance(layer, C.QuantizedKVCache):
            out.extend(a[..., : entry["offset"], :] for a in (*layer.keys, *layer.values))
        else:
            out.extend(
                [layer.keys[..., : entry["offset"], :], layer.values[..., : entry["offset"], :]]
            )
    for att in loaded.attachments:
        out.extend(att.tensors)
    return out


def _fields(header: dict[str, Any]) -> dict[str, Any]:
    """The header without what legitimately differs between v3 and v5: version, blocks."""
    h: dict[str, Any] = json.loads(json.dumps(header))
    h.pop("formatVersion")
    for group in (h["caches"], h.get("attachments", [])):
        for entry in group:
            for slot in entry["tensors"]:
                slot.pop("blocks", None)
    return h


def _same_file_content(a: Loaded, b: Loaded) -> None:
    assert _fields(a.header) == _fields(b.header)
    assert list(a.header) == list(b.header)  # key order too
    ta, tb = _stored(a), _stored(b)
    assert len(ta) == len(tb)
    assert all(same_bits(x, y) for x, y in zip(ta, tb, strict=True))
    assert [(x.schema, x.metadata) for x in a.attachments] == [
        (x.schema, x.metadata) for x in b.attachments
    ]


def _snapshot(store: kvstore.Store) -> tuple[kvstore.Stats, list[str]]:
    blocks = sorted(str(p.relative_to(store.root)) for p in (store.root / "blocks").rglob("*"))
    return store.stats(), blocks


# --- mlx-bun samples ------------------------------------------------------------------


@pytest.mark.parametrize("name", V3_SAMPLES)
def test_v3_sample_round_trips_byte_for_byte(tmp_path: Path, name: str) -> None:
    src = _sample(name)
    original = load_v3(src, verify=True)
    with _open(tmp_path / "root") as store:
        info = store.import_file(src)
        m = store.manifest(info.id)
        assert m.namespace == original.namespace
        assert m.metadata[CREATED_AT_KEY] == str(original.header["createdAt"])
        assert m.metadata[FORMAT_VERSION_KEY] == str(original.format_version)
        assert [a.schema for a in m.attachments] == [a.schema for a in original.attachments]
        assert info.n_tokens == len(original.tokens)

        (tmp_path / "v3").mkdir()
        (tmp_path / "v5").mkdir()
        v3 = store.export(info.id, tmp_path / "v3" / src.name)
        assert v3.read_bytes() == src.read_bytes()
        _same_file_content(load_v3(v3, verify=True), original)

        v5 = store.export(info.id, tmp_path / "v5" / src.name, format="v5")
        again = load_v3(v5, verify=True)
        assert again.format_version == 5
        _same_file_content(again, original)


def test_v5_sample_round_trips_with_its_blocks(tmp_path: Path) -> None:
    src = _sample("mixed-blocks-v5")
    original = load_v3(src, verify=True)
    with _open(tmp_path / "root") as store:
        info = store.import_file(src)
        m = store.manifest(info.id)
        assert m.metadata[FORMAT_VERSION_KEY] == "5"
        assert m.metadata[BLOCK_BYTES_KEY] == "32768"

        (tmp_path / "v5").mkdir()
        v5 = store.export(info.id, tmp_path / "v5" / src.name, format="v5")
        assert v5.read_bytes() == src.read_bytes()
        ours = {p.name: p.read_bytes() for p in (tmp_path / "v5" / "blocks").iterdir()}
        theirs = {p.name: p.read_bytes() for p in (SAMPLES / "blocks").iterdir()}
        assert ours == theirs
        _same_file_content(load_v3(v5, verify=True), original)

        v3 = store.export(info.id, tmp_path / "x.kv")
        back = load_v3(v3, verify=True)
        assert back.format_version == 3
        _same_file_content(back, original)
        # the v3 sample with the same content is exactly what a v3 export writes
        assert v3.read_bytes() == _sample("mixed").read_bytes()


def test_store_methods_delegate_and_accept_an_id_prefix(tmp_path: Path) -> None:
    src = _sample("with-attachments")
    with _open(tmp_path / "root") as store:
        info = store.import_file(src, verify=False)
        out = store.export(info.id[:8], tmp_path / "x.kv")
        assert out == tmp_path / "x.kv"
        assert out.read_bytes() == src.read_bytes()
        (tmp_path / "v5").mkdir()
        load_v3(store.export(info.id, tmp_path / "v5" / "x.kv", format="v5"), verify=True)
        with pytest.raises(ValueError, match="format"):
            store.export(info.id, tmp_path / "y.kv", format="v9")  # type: ignore[arg-type]


def test_namespace_override_and_identity_less_files(tmp_path: Path) -> None:
    other = kvstore.Namespace(model_id="m2", config_fingerprint="c2", tokenizer_hash="t2", ns="x")
    with _open(tmp_path / "root") as store:
        info = store.import_file(_sample("tiny"), namespace=other)
        assert store.manifest(info.id).namespace == other
        head = load_v3(store.export(info.id, tmp_path / "o.kv")).header
        assert (head["modelId"], head["configFingerprint"], head["tokenizerHash"], head["ns"]) == (
            "m2",
            "c2",
            "t2",
            "x",
        )

        # a file without identity needs a namespace, and exports without one again
        bare = tmp_path / "bare.kv"
        save_v3(bare, list(range(40)), [kv_cache(40, seed=3)], created_at=1234)
        before = _snapshot(store)
        with pytest.raises(NamespaceRequiredError):
            store.import_file(bare)
        assert _snapshot(store) == before
        info = store.import_file(bare, namespace=NS)
        assert store.manifest(info.id).metadata[IDENTITY_KEY] == "none"
        assert store.export(info.id, tmp_path / "bare2.kv").read_bytes() == bare.read_bytes()


# --- entries saved from mlx-lm caches -----------------------------------------------


def _mlx_lm_caches(n: int) -> list[Any]:
    return [
        kv_cache(n, seed=1, dtype=mx.bfloat16),
        rotating_cache(n, max_size=32, seed=2),  # wrapped
        rotating_cache(n, max_size=256, seed=3, dtype=mx.float16),  # not wrapped
        quantized_cache(n, seed=4, bits=8, group_size=32),
        arrays_cache(seed=5),
        kv_cache(n, seed=6, dtype=mx.float32, chunks=3),
    ]


def _entry_arrays(cache: list[Any]) -> list[mx.array]:
    return [a for layer in cache for a in state_arrays(layer)]


def test_saved_entry_exports_and_reimports_the_same_tensors(tmp_path: Path) -> None:
    n = 150
    tokens = list(range(1000, 1000 + n))
    attachment = kvstore.codecs.AttachmentData(
        "test/v1", b'{"k":[1,2]}', (mx.arange(12, dtype=mx.int32).reshape(3, 4),)
    )
    with _open(tmp_path / "a", namespace=NS) as store:
        info = store.save(tokens, _mlx_lm_caches(n), attachments=[attachment])
        m = store.manifest(info.id)
        _, want, want_atts = store.load_entry(info.id)
        (tmp_path / "v5").mkdir()
        files = [
            store.export(info.id, tmp_path / "x.kv"),
            store.export(info.id, tmp_path / "v5" / "x.kv", format="v5"),
        ]
        for f in files:
            loaded = load_v3(f, verify=True)
            assert loaded.header["createdAt"] == m.created_at
            assert loaded.namespace == NS
            assert loaded.tokens == tokens
            assert loaded.format_version == (4 if f.parent == tmp_path else 5)
        # into the same store: the same entry, nothing written
        again = store.import_file(files[0])
        assert (again.id, again.new_bytes) == (info.id, 0)

    for i, f in enumerate(files):
        with _open(tmp_path / f"b{i}") as fresh:
            got_info = fresh.import_file(f)
            got_tokens, got, got_atts = fresh.load_entry(got_info.id)
            assert got_tokens == tokens
            assert [type(c) for c in got] == [type(c) for c in want]
            ga, wa = _entry_arrays(got), _entry_arrays(want)
            assert len(ga) == len(wa)
            assert all(same_bits(x, y) for x, y in zip(ga, wa, strict=True))
            for g, w in zip(got, want, strict=True):
                for attr in ("offset", "_idx", "max_size", "keep", "group_size", "bits"):
                    assert getattr(g, attr, None) == getattr(w, attr, None), attr
            assert [(a.schema, a.metadata) for a in got_atts] == [
                (a.schema, a.metadata) for a in want_atts
            ]
            assert all(
                same_bits(x, y)
                for ga_, wa_ in zip(got_atts, want_atts, strict=True)
                for x, y in zip(ga_.tensors, wa_.tensors, strict=True)
            )


# --- dedup and failure -------------------------------------------------------------


def test_imports_sharing_a_prefix_store_its_blocks_once(tmp_path: Path) -> None:
    T = 32
    shared = list(range(4 * T))
    a = shared + list(range(5000, 5000 + 2 * T))
    b = shared + list(range(6000, 6000 + 3 * T))
    for name, toks in (("a.kv", a), ("b.kv", b)):
        save_v3(
            tmp_path / name,
            toks,
            [prefix_cache(toks), prefix_cache(toks, mx.float16)],
            namespace=NS,
            created_at=1,
        )

    def alone(name: str) -> kvstore.Stats:
        with _open(tmp_path / f"alone-{name}", block_tokens=T) as s:
            s.import_file(tmp_path / name)
            return s.stats()

    sa, sb = alone("a.kv"), alone("b.kv")
    with _open(tmp_path / "both", block_tokens=T) as store:
        ia = store.import_file(tmp_path / "a.kv")
        ib = store.import_file(tmp_path / "b.kv")
        s = store.stats()
    shared_bytes = 4 * T * 2 * (2 * 2 * 32 * 2)  # 4 blocks x 2 layers x (K+V, H=2, D=32, bf16)
    assert ia.new_bytes == sa.physical_bytes
    assert ib.new_bytes == sb.physical_bytes - shared_bytes
    assert s.entries == 2
    assert s.blocks == sa.blocks + sb.blocks - 4
    assert s.physical_bytes == sa.physical_bytes + sb.physical_bytes - shared_bytes
    assert s.logical_bytes == sa.logical_bytes + sb.logical_bytes


def _flip(src: Path, dst: Path, at: int) -> Path:
    data = bytearray(src.read_bytes())
    data[at] ^= 0x01
    dst.write_bytes(bytes(data))
    return dst


def test_corrupt_files_raise_and_leave_the_store_unchanged(tmp_path: Path) -> None:
    src = _sample("with-attachments")
    header = load_v3(src).header
    first = 16384 + header["caches"][0]["tensors"][0]["off"]  # dataStart + off
    with _open(tmp_path / "root") as store:
        store.import_file(_sample("tiny"))
        before = _snapshot(store)
        bad_header = _flip(src, tmp_path / "h.kv", PREFIX_LEN + 5)
        with pytest.raises(HeaderHashMismatchError) as e:
            store.import_file(bad_header)
        assert isinstance(e.value, FileFormatError) and e.value.path == str(bad_header)
        assert _snapshot(store) == before

        bad_tensor = _flip(src, tmp_path / "t.kv", first + 3)
        with pytest.raises(TensorHashMismatchError):
            store.import_file(bad_tensor)
        assert _snapshot(store) == before
        assert not list((store.root / "tmp").iterdir())
