"""Every check of mlx-bun's readKvHeader/loadKvCache, one corrupted sample each.

Each sample is built here from a good one (tests/data/mlx-bun-v3): the header
is edited, re-hashed and, when it grows, the data region moves with dataStart
(tensor ``off`` is relative to it). Each must be refused with its typed error,
with and without tensor verification; the same edit left benign must load.
"""

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
    AllocationBoundError,
    BlockReferenceError,
    CodecProviderMismatchError,
    FileFormatError,
    HeaderFieldError,
    MalformedHeaderError,
    TensorOverlapError,
    TensorShapeError,
    TensorShapeMismatchError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from kvstore.formats.v3 import check_header, load_v3, read_header

PREFIX = 26
ALIGN = 16384
Mutate = Callable[[dict[str, Any]], Any]


def rebuild(src: Path, dst: Path, mutate: Mutate | None = None, body: bytes | None = None) -> Path:
    """``src`` with its header edited by ``mutate`` (or replaced by ``body``), re-hashed."""
    raw = src.read_bytes()
    n, data_start = struct.unpack_from("<II", raw, 10)
    header = json.loads(raw[PREFIX : PREFIX + n])
    if mutate is not None:
        mutate(header)
    if body is None:
        body = json.dumps(header, separators=(",", ":")).encode()
    new_start = -(-(PREFIX + len(body)) // ALIGN) * ALIGN
    pre = bytearray(new_start)
    pre[:10] = raw[:10]
    struct.pack_into("<IIQ", pre, 10, len(body), new_start, bun_hash(body))
    pre[PREFIX : PREFIX + len(body)] = body
    dst.write_bytes(bytes(pre) + raw[data_start:])
    return dst


def _sample(samples_dir: Path, tmp_path: Path, name: str) -> Path:
    if name.endswith("-v5"):
        shutil.copytree(samples_dir / "blocks", tmp_path / "blocks", dirs_exist_ok=True)
    return samples_dir / f"{name}.kv"


def _set(path: list[Any], value: Any) -> Mutate:
    def mutate(h: dict[str, Any]) -> None:
        obj: Any = h
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return mutate


def _drop(path: list[Any]) -> Mutate:
    def mutate(h: dict[str, Any]) -> None:
        obj: Any = h
        for k in path[:-1]:
            obj = obj[k]
        del obj[path[-1]]
    return mutate


def _as_kind(layer: int, kind: str, keep: int | None = None, **fields: Any) -> Mutate:
    """Layer ``layer`` relabelled as a kind with no mlx-lm class (kept tensors: ``keep``)."""
    def mutate(h: dict[str, Any]) -> None:
        e = h["caches"][layer]
        tensors = e["tensors"][:keep] if keep is not None else e["tensors"]
        h["caches"][layer] = {"kind": kind, "offset": e["offset"], **fields, "tensors": tensors}
    return mutate


def _both(*ms: Mutate) -> Mutate:
    def mutate(h: dict[str, Any]) -> None:
        for m in ms:
            m(h)
    return mutate


# (sample, edit, error class, words the message holds)
BAD: dict[str, tuple[str, Mutate, type[FileFormatError], str]] = {
    # readKvHeader
    "formatVersion-string": ("tiny", _set(["formatVersion"], "3"), UnsupportedVersionError,
                             "formatVersion '3'"),
    "formatVersion-6": ("tiny", _set(["formatVersion"], 6), UnsupportedVersionError,
                        "formatVersion 6"),
    # validateKvHeader
    "codecProvider": ("tiny", _set(["codecProvider"], "paged-v1"), CodecProviderMismatchError,
                      "'paged-v1'"),
    "caches-empty": ("tiny", _set(["caches"], []), HeaderFieldError, "no cache layers"),
    "caches-not-list": ("tiny", _set(["caches"], {"0": 1}), HeaderFieldError, "dict"),
    "kind-unknown": ("tiny", _set(["caches", 0, "kind"], "martian"), HeaderFieldError,
                     "'martian'"),
    "kind-missing": ("tiny", _drop(["caches", 0, "kind"]), HeaderFieldError, "no 'kind'"),
    "tensors-missing": ("tiny", _drop(["caches", 0, "tensors"]), HeaderFieldError,
                        "'tensors'"),
    # cacheHeaderMinimumReusableOffset (the class accepted before)
    "mro-above-offset": ("tiny", _set(["caches", 0, "minimumReusableOffset"], 6),
                         HeaderFieldError, "minimumReusableOffset 6 with offset 5"),
    "mro-negative": ("tiny", _set(["caches", 0, "minimumReusableOffset"], -1),
                     HeaderFieldError, "minimumReusableOffset -1"),
    "mro-fraction": ("tiny", _set(["caches", 0, "minimumReusableOffset"], 2.5),
                     HeaderFieldError, "minimumReusableOffset 2.5"),
    "mro-string": ("tiny", _set(["caches", 0, "minimumReusableOffset"], "0"),
                   HeaderFieldError, "minimumReusableOffset '0'"),
    "mro-unsafe": ("tiny", _both(_set(["caches", 0, "offset"], 2**60),
                                 _set(["caches", 0, "minimumReusableOffset"], 2**53)),
                   HeaderFieldError, "minimumReusableOffset 9007199254740992"),
    "mro-turboquant-default": ("mixed", _as_kind(2, "turboquant", 5, kBits=4, vBits=4,
                                                 headDim=64, offset=None),
                               HeaderFieldError, "minimumReusableOffset None"),
    # codec.load: each kind's tensors and fields
    "kv-one-tensor": ("tiny", lambda h: h["caches"][0]["tensors"].pop(), HeaderFieldError,
                      "1 tensors, expected 2"),
    "kv-offset-missing": ("tiny", _drop(["caches", 0, "offset"]), HeaderFieldError,
                          "'offset'"),
    "kv-offset-past-rows": ("tiny", _set(["caches", 0, "offset"], 6), HeaderFieldError,
                            "does not hold offset 6"),
    "kv-3d": ("tiny", lambda h: [t.update(shape=[1, 5, 8]) for t in h["caches"][0]["tensors"]],
              HeaderFieldError, "[1, 5, 8]"),
    "rotating-maxSize": ("mixed", _drop(["caches", 1, "maxSize"]), HeaderFieldError,
                         "'maxSize'"),
    "rotating-idx": ("mixed", _set(["caches", 1, "idx"], -3), HeaderFieldError, "'idx' is -3"),
    "qkv-bits": ("mixed", _set(["caches", 2, "bits"], "4"), HeaderFieldError, "'bits'"),
    "qkv-five-tensors": ("mixed", lambda h: h["caches"][2]["tensors"].pop(), HeaderFieldError,
                         "5 tensors, expected 6"),
    "ssm-one-tensor": ("mixed", lambda h: h["caches"][3]["tensors"].pop(), HeaderFieldError,
                       "1 tensors"),
    "rotating-qkv-groupSize": ("mixed", _as_kind(2, "rotating-qkv", idx=3, maxSize=512, bits=4),
                               HeaderFieldError, "'groupSize'"),
    "rotating-qkv-tensors": ("mixed", _as_kind(2, "rotating-qkv", 5, idx=3, maxSize=512,
                                               groupSize=64, bits=4),
                             HeaderFieldError, "5 tensors, expected 6"),
    "turboquant-kBits": ("mixed", _as_kind(2, "turboquant", 5, vBits=4, headDim=64),
                         HeaderFieldError, "'kBits'"),
    "turboquant-tensors": ("mixed", _as_kind(2, "turboquant", kBits=4, vBits=4, headDim=64),
                           HeaderFieldError, "6 tensors, expected 5"),
    "mla-kvLoraRank": ("mixed", _as_kind(0, "mla", ropeHeadDim=64), HeaderFieldError,
                       "'kvLoraRank'"),
    "mla-dsa-tensors": ("mixed", _as_kind(0, "mla-dsa", kvLoraRank=64, ropeHeadDim=64,
                                          dsaHeadDim=64),
                        HeaderFieldError, "2 tensors, expected 3"),
    "mtp-mla-dsa": ("mixed", _as_kind(0, "mtp-mla", kvLoraRank=64, ropeHeadDim=64,
                                      dsaHeadDim=64),
                    HeaderFieldError, "cannot contain DSA state"),
    # attachments ?? [] and attachment.tensors.map
    "attachments-not-list": ("with-attachments", _set(["attachments"], {"a": 1}),
                             HeaderFieldError, "'attachments' is dict"),
    "attachment-tensors": ("with-attachments", _drop(["attachments", 0, "tensors"]),
                           HeaderFieldError, "attachment 0"),
    # tensor records (fromBytesCopy(bytes, shape, dtype))
    "record-not-object": ("tiny", _set(["caches", 0, "tensors", 0], [0, 80]), HeaderFieldError,
                          "tensor record is list"),
    "record-string": ("mixed", _set(["caches", 3, "tensors", 1], "x"), HeaderFieldError,
                      "tensor record is str"),
    "off-negative": ("tiny", _set(["caches", 0, "tensors", 1, "off"], -16384),
                     HeaderFieldError, "'off' -16384"),
    "bytes-float": ("tiny", _set(["caches", 0, "tensors", 1, "bytes"], 80.5), HeaderFieldError,
                    "'bytes' 80.5"),
    "shape-not-list": ("tiny", _set(["caches", 0, "tensors", 1, "shape"], "1,1,5,8"),
                       HeaderFieldError, "shape '1,1,5,8'"),
    "dtype": ("tiny", _set(["caches", 0, "tensors", 1, "dtype"], "complex128"),
              HeaderFieldError, "'complex128'"),
    "bytes-vs-shape": ("tiny", _set(["caches", 0, "tensors", 1, "bytes"], 160),
                       TensorShapeMismatchError, "160 bytes"),
    "65-dims": ("mixed", _set(["caches", 3, "tensors", 1], {
        "off": 0, "bytes": 4, "shape": [1] * 65, "dtype": "float32", "hash": "0" * 16}),
        TensorShapeError, "65 dimensions"),
    "dim-2**31": ("mixed", _set(["caches", 3, "tensors", 1, "shape"], [0, 2**31]),
                  TensorShapeError, "2147483648"),
    "zero-size-2d": ("with-attachments", _set(["attachments", 1, "tensors", 0], {
        "off": 0, "bytes": 0, "shape": [4, 0], "dtype": "float32", "hash": "0" * 16}),
        TensorShapeError, "zero-size with 2 dimensions"),
    # v3 data: mmap.view(dataStart + off, bytes)
    "off-past-end": ("tiny", _set(["caches", 0, "tensors", 1, "off"], 10**9), FileFormatError,
                     "outside the file"),
    "shared-offset": ("tiny", _set(["caches", 0, "tensors", 1, "off"], 0), TensorOverlapError,
                      "overlap cache layer 0 (kv) tensor 0"),
    # v5 block references
    "v5-hash-newline": ("mixed-blocks-v5", lambda h: h["caches"][0]["tensors"][0]["blocks"][0]
                        .update(hash=h["caches"][0]["tensors"][0]["blocks"][0]["hash"] + "\n"),
                        BlockReferenceError, "invalid KV block reference"),
    "v5-block-bytes-string": ("mixed-blocks-v5", _set(["caches", 0, "tensors", 0, "blocks", 0,
                                                       "bytes"], "32768"),
                              BlockReferenceError, "invalid KV block reference"),
    "v5-blocks-beyond-tensor": ("mixed-blocks-v5", lambda h: h["caches"][0]["tensors"][0]
                                ["blocks"].append(h["caches"][0]["tensors"][0]["blocks"][0]),
                                BlockReferenceError, "invalid KV block reference"),
    "v5-blocks-missing": ("mixed-blocks-v5", _drop(["caches", 0, "tensors", 0, "blocks"]),
                          BlockReferenceError, "blocks hold 0 bytes, tensor needs 76800"),
    "v5-blocks-not-list": ("mixed-blocks-v5", _set(["caches", 0, "tensors", 0, "blocks"], "x"),
                           BlockReferenceError, "not a list"),
}

# Benign twins: the same fields, kept in range, load.
GOOD: dict[str, tuple[str, Mutate]] = {
    "mro-equal-offset": ("tiny", _set(["caches", 0, "minimumReusableOffset"], 5)),
    "mro-null": ("tiny", _set(["caches", 0, "minimumReusableOffset"], None)),
    "codecProvider-null": ("tiny", _set(["codecProvider"], None)),
    "codecProvider-absent": ("tiny", _drop(["codecProvider"])),
    "attachments-null": ("tiny", _set(["attachments"], None)),
    "rotating-qkv": ("mixed", _as_kind(2, "rotating-qkv", idx=3, maxSize=512, groupSize=64,
                                       bits=4)),
    "turboquant": ("mixed", _as_kind(2, "turboquant", 5, kBits=4, vBits=4, headDim=64)),
    "mla-dsa": ("mixed", _as_kind(2, "mla-dsa", 3, kvLoraRank=64, ropeHeadDim=64,
                                  dsaHeadDim=64)),
    "mtp-mla": ("mixed", _as_kind(0, "mtp-mla", kvLoraRank=64, ropeHeadDim=64)),
    "zero-size-1d": ("with-attachments", _set(["attachments", 1, "tensors", 0], {
        "off": 0, "bytes": 0, "shape": [0], "dtype": "float32", "hash": "0409638ee2bde459"})),
}


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_refused_as_mlx_bun_refuses(
    samples_dir: Path, tmp_path: Path, case: str, verify: bool
) -> None:
    name, mutate, kind, words = BAD[case]
    p = rebuild(_sample(samples_dir, tmp_path, name), tmp_path / f"{case}.kv", mutate)
    with pytest.raises(kind) as info:
        load_v3(p, verify=verify)
    assert str(p) in str(info.value) and words in str(info.value), str(info.value)
    if kind is not CodecProviderMismatchError:  # inspect shows another provider's file
        with pytest.raises(kind):  # what `inspect` runs: the same check, no data read
            check_header(read_header(p))


@pytest.mark.parametrize("case", sorted(GOOD))
def test_benign_twins_load(samples_dir: Path, tmp_path: Path, case: str) -> None:
    name, mutate = GOOD[case]
    p = rebuild(_sample(samples_dir, tmp_path, name), tmp_path / f"{case}.kv", mutate)
    loaded = load_v3(p, verify=True)
    assert loaded.cache


# --- the JSON header, as JSON.parse(new TextDecoder().decode(body)) reads it ------


@pytest.mark.parametrize("body", [
    b'{"formatVersion":3,"x":' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    b'{"formatVersion":3,"x":NaN}',
    b'{"formatVersion":3,"x":-Infinity}',
    '{"formatVersion":3}'.encode("utf-16"),
    b'{"formatVersion":3,"x":"\xff"}',
    b"[3]",
], ids=["nested-200000", "NaN", "Infinity", "utf-16", "not-utf-8", "array"])
def test_header_json_as_mlx_bun_parses_it(samples_dir: Path, tmp_path: Path, body: bytes) -> None:
    p = rebuild(samples_dir / "tiny.kv", tmp_path / "h.kv", body=body)
    with pytest.raises(MalformedHeaderError) as info:
        read_header(p)
    assert str(p) in str(info.value)


def test_header_with_a_bom_reads(samples_dir: Path, tmp_path: Path) -> None:
    raw = (samples_dir / "tiny.kv").read_bytes()
    n = struct.unpack_from("<I", raw, 10)[0]
    p = rebuild(samples_dir / "tiny.kv", tmp_path / "bom.kv", body=b"\xef\xbb\xbf" + raw[26:26 + n])
    assert load_v3(p).tokens == [1, 2, 3, 4, 5]  # TextDecoder drops the BOM


def test_header_length_of_4_gib_is_not_allocated(samples_dir: Path, tmp_path: Path) -> None:
    p = tmp_path / "huge.kv"
    raw = bytearray((samples_dir / "tiny.kv").read_bytes())
    struct.pack_into("<I", raw, 10, 2**32 - 1)
    p.write_bytes(bytes(raw))
    with pytest.raises(TruncatedFileError, match="header length 4294967295"):
        read_header(p)


# --- bounds before allocating (issue 17 item 4) -----------------------------------


def test_records_sharing_bytes_are_refused(samples_dir: Path, tmp_path: Path) -> None:
    """Many records at one offset: a small file that would restore as many times its size."""
    def mutate(h: dict[str, Any]) -> None:
        t = h["caches"][0]["tensors"][0]
        h["caches"] = [{"kind": "kv", "offset": 5, "tensors": [dict(t), dict(t)]}
                       for _ in range(1000)]
    p = rebuild(samples_dir / "tiny.kv", tmp_path / "shared.kv", mutate)
    with pytest.raises(TensorOverlapError, match="cache layer 0 \\(kv\\) tensor 1"):
        load_v3(p)


def test_regrowth_is_bounded_by_one_step(samples_dir: Path, tmp_path: Path) -> None:
    """Dense 16-byte records, each regrown to 256 rows: within the margin; past it, refused."""
    from kvstore.formats import _v3io

    def mutate(h: dict[str, Any]) -> None:
        h["tokens"] = [1]
        h["caches"] = [{"kind": "kv", "offset": 1, "tensors": [
            {"off": 32 * i + 16 * k, "bytes": 16, "shape": [1, 1, 1, 8], "dtype": "bfloat16",
             "hash": "0" * 16} for k in range(2)]} for i in range(64)]
    p = rebuild(samples_dir / "tiny.kv", tmp_path / "dense.kv", mutate)
    info = read_header(p)
    checked = check_header(info)
    total = sum(t.nbytes for t in checked.tensors)
    assert total == 128 * 256 * 16 and total > info.file_size  # 1-token rows regrown to 256
    _v3io.check_allocation(str(p), checked.tensors, info.file_size)  # the stated margin
    slot = checked.tensors[0].slot
    with pytest.raises(AllocationBoundError, match="adds more than 256 rows"):
        _v3io.TensorPlan.make(str(p), slot, "t", _v3io.FileRange(str(p), -1, 0, 16), 258, False)
    assert len(load_v3(p).cache) == 64  # within the margin: loads, as mlx-bun's does


def test_total_allocation_check_names_the_largest_tensor(tmp_path: Path) -> None:
    from kvstore.formats._v3io import FileRange, TensorPlan, check_allocation

    slot = {"off": 0, "bytes": 64, "shape": [1, 1, 4, 8], "dtype": "bfloat16"}
    plan = TensorPlan.make("f.kv", slot, "cache layer 7 (kv) tensor 1",
                           FileRange("f.kv", -1, 0, 64), None, False)
    with pytest.raises(AllocationBoundError, match="cache layer 7 \\(kv\\) tensor 1"):
        check_allocation("f.kv", [plan], stored_limit=63)
