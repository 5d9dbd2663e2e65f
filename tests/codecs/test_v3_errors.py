"""Corrupted copies of the samples: each gives its specific, named error — never bad data."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.formats.bunhash import bun_hash
from kvstore.formats.errors import (
    BadMagicError,
    BlockReferenceError,
    CodecProviderMismatchError,
    FileFormatError,
    HeaderHashMismatchError,
    NamespaceMismatchError,
    TensorHashMismatchError,
    TensorOutOfBoundsError,
    TensorShapeMismatchError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from kvstore.formats.v3 import load_v3, read_header
from kvstore.schema import Namespace

PREFIX = 26


def _copy(samples_dir: Path, tmp_path: Path, name: str = "tiny") -> Path:
    dst = tmp_path / f"{name}.kv"
    shutil.copyfile(samples_dir / f"{name}.kv", dst)
    return dst


def _patch(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


def _rewrite_header(path: Path, mutate: Callable[[dict[str, Any]], Any]) -> None:
    """Edit the JSON header and re-hash it, keeping the tensor data where it was."""
    raw = path.read_bytes()
    n, data_start = struct.unpack_from("<II", raw, 10)
    header = json.loads(raw[PREFIX : PREFIX + n])
    mutate(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    assert PREFIX + len(body) <= data_start
    pre = bytearray(data_start)
    pre[:10] = raw[:10]
    struct.pack_into("<IIQ", pre, 10, len(body), data_start, bun_hash(body))
    pre[PREFIX : PREFIX + len(body)] = body
    path.write_bytes(bytes(pre) + raw[data_start:])


def _raises(kind: type[FileFormatError], path: Path, **kw: Any) -> FileFormatError:
    with pytest.raises(kind) as info:
        load_v3(path, **kw)
    err = info.value
    assert isinstance(err, FileFormatError) and isinstance(err, ValueError)
    assert str(path) in str(err) and err.path == str(path)
    return err


def test_bad_magic(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy(samples_dir, tmp_path)
    _patch(p, 0, b"GGUF")
    assert "magic" in str(_raises(BadMagicError, p))
    with pytest.raises(BadMagicError):
        read_header(p)


def test_header_hash_mismatch(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy(samples_dir, tmp_path)
    raw = p.read_bytes()
    at = raw.index(b'"tokens":[1') + len(b'"tokens":[')
    _patch(p, at, b"7")  # same length, different header
    assert "header hash" in str(_raises(HeaderHashMismatchError, p))


def test_unsupported_version(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy(samples_dir, tmp_path)
    _rewrite_header(p, lambda h: h.update(formatVersion=2))
    assert "formatVersion 2" in str(_raises(UnsupportedVersionError, p))


def test_codec_provider_mismatch(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy(samples_dir, tmp_path)
    _rewrite_header(p, lambda h: h.update(codecProvider="someone-else"))
    assert "someone-else" in str(_raises(CodecProviderMismatchError, p))


def test_tensor_hash_mismatch_only_when_verifying(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy(samples_dir, tmp_path)
    info = read_header(p)
    slot = info.header["caches"][0]["tensors"][1]
    at = info.data_start + slot["off"] + 3
    _patch(p, at, bytes([p.read_bytes()[at] ^ 0xFF]))
    load_v3(p)  # tensor hashes are opt-in, as in mlx-bun
    err = _raises(TensorHashMismatchError, p, verify=True)
    assert isinstance(err, TensorHashMismatchError)
    assert err.expected == slot["hash"] and err.actual != err.expected
    assert "tensor 1" in str(err)


def test_tensor_outside_the_file(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy(samples_dir, tmp_path)
    _rewrite_header(p, lambda h: h["caches"][0]["tensors"][1].update(off=10**9))
    assert "outside the file" in str(_raises(TensorOutOfBoundsError, p))


@pytest.mark.parametrize("change", [{"bytes": 81}, {"dtype": "float32"}, {"shape": [1, 1, 6, 8]}])
def test_bytes_disagree_with_shape_and_dtype(
    samples_dir: Path, tmp_path: Path, change: dict[str, Any]
) -> None:
    p = _copy(samples_dir, tmp_path)
    _rewrite_header(p, lambda h: h["caches"][0]["tensors"][0].update(change))
    _raises(TensorShapeMismatchError, p)


@pytest.mark.parametrize("keep", [-10, 20, 100])  # inside the last tensor, prefix, header
def test_truncated_file(samples_dir: Path, tmp_path: Path, keep: int) -> None:
    p = _copy(samples_dir, tmp_path)
    raw = p.read_bytes()
    p.write_bytes(raw[:keep])
    _raises(TruncatedFileError, p)


def test_empty_file_is_truncated(tmp_path: Path) -> None:
    p = tmp_path / "empty.kv"
    p.write_bytes(b"")
    _raises(TruncatedFileError, p)


def test_namespace_mismatch(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy(samples_dir, tmp_path)
    ok = Namespace(model_id="oracle-model", config_fingerprint="cfg-1",
                   tokenizer_hash="tok-1", ns="default")
    load_v3(p, namespace=ok)
    for field, value in [("model_id", "other"), ("config_fingerprint", "cfg-2"),
                         ("tokenizer_hash", "tok-2"), ("ns", "adapter")]:
        bad = Namespace(**{**{"model_id": "oracle-model", "config_fingerprint": "cfg-1",
                              "tokenizer_hash": "tok-1", "ns": "default"}, field: value})
        assert repr(value) in str(_raises(NamespaceMismatchError, p, namespace=bad))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: h["caches"][0].update(kind="martian"),
        lambda h: h["caches"][0]["tensors"].pop(),
        lambda h: h["caches"][0].update(offset=6),
        lambda h: h.update(tokens="12345"),
        lambda h: h["caches"][0]["tensors"][0].update(dtype="complex128"),
    ],
    ids=["unknown-kind", "missing-tensor", "offset-beyond-rows", "tokens", "dtype"],
)
def test_malformed_layers(
    samples_dir: Path, tmp_path: Path, mutate: Callable[[dict[str, Any]], Any]
) -> None:
    p = _copy(samples_dir, tmp_path)
    _rewrite_header(p, mutate)
    _raises(FileFormatError, p)


def test_header_not_json(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy(samples_dir, tmp_path)
    raw = p.read_bytes()
    n = struct.unpack_from("<I", raw, 10)[0]
    body = b"{" * n
    _patch(p, 18, struct.pack("<Q", bun_hash(body)) + body)
    assert "JSON" in str(_raises(FileFormatError, p))


# --- v5 blocks ---------------------------------------------------------------


def _copy_v5(samples_dir: Path, tmp_path: Path) -> Path:
    shutil.copytree(samples_dir / "blocks", tmp_path / "blocks")
    for b in (tmp_path / "blocks").iterdir():
        b.chmod(0o644)
    return _copy(samples_dir, tmp_path, "mixed-blocks-v5")


def test_v5_missing_block(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy(samples_dir, tmp_path, "mixed-blocks-v5")  # no blocks/ beside it
    assert "missing" in str(_raises(BlockReferenceError, p))


def test_v5_corrupt_block_when_verifying(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy_v5(samples_dir, tmp_path)
    digest = read_header(p).header["caches"][3]["tensors"][1]["blocks"][0]["hash"]
    block = tmp_path / "blocks" / digest
    raw = bytearray(block.read_bytes())
    raw[0] ^= 1
    block.write_bytes(bytes(raw))
    load_v3(p)
    err = _raises(TensorHashMismatchError, p, verify=True)
    assert digest in str(err)


def test_v5_block_of_wrong_size(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy_v5(samples_dir, tmp_path)
    digest = read_header(p).header["caches"][0]["tensors"][0]["blocks"][2]["hash"]
    block = tmp_path / "blocks" / digest
    block.write_bytes(block.read_bytes()[:-1])
    _raises(BlockReferenceError, p)


@pytest.mark.parametrize("ref", [{"hash": "../../tiny.kv", "bytes": 32768},
                                 {"hash": "a" * 64, "bytes": 0}, "nope"])
def test_v5_invalid_block_reference(samples_dir: Path, tmp_path: Path, ref: Any) -> None:
    p = _copy_v5(samples_dir, tmp_path)
    _rewrite_header(p, lambda h: h["caches"][0]["tensors"][0]["blocks"].__setitem__(0, ref))
    assert "invalid KV block reference" in str(_raises(BlockReferenceError, p))


def test_v5_blocks_shorter_than_tensor(samples_dir: Path, tmp_path: Path) -> None:
    p = _copy_v5(samples_dir, tmp_path)
    _rewrite_header(p, lambda h: h["caches"][0]["tensors"][0]["blocks"].pop())
    _raises(BlockReferenceError, p)
