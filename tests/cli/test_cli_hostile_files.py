"""inspect and import of hostile or truncated mlx-bun files: an error line, or a truncation."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import assert_user_error, run_here, run_many

from kvstore.formats.bunhash import bun_hash

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "mlx-bun-v3"
ALIGN = 16384


def _build(dst: Path, mutate: Callable[[dict[str, Any]], Any] | None = None,
           body: bytes | None = None, sample: str = "mixed") -> Path:
    """A copy of a sample with its header edited (or replaced) and re-hashed."""
    raw = (SAMPLES / f"{sample}.kv").read_bytes()
    n, data_start = struct.unpack_from("<II", raw, 10)
    header = json.loads(raw[26 : 26 + n])
    if mutate is not None:
        mutate(header)
    if body is None:
        body = json.dumps(header, separators=(",", ":")).encode()
    start = -(-(26 + len(body)) // ALIGN) * ALIGN
    pre = bytearray(start)
    pre[:10] = raw[:10]
    struct.pack_into("<IIQ", pre, 10, len(body), start, bun_hash(body))
    pre[26 : 26 + len(body)] = body
    dst.write_bytes(bytes(pre) + raw[data_start:])
    return dst


def _ssm_tensor(value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: h["caches"][3]["tensors"].__setitem__(0, value)


def _huge_header_length(p: Path) -> Path:
    raw = bytearray((SAMPLES / "tiny.kv").read_bytes())
    struct.pack_into("<I", raw, 10, 2**32 - 1)
    p.write_bytes(bytes(raw))
    return p


HOSTILE: dict[str, tuple[Callable[[Path], Path], str]] = {
    "nested-200000": (lambda p: _build(p, body=b'{"formatVersion":3,"x":' + b"[" * 200_000
                                       + b"]" * 200_000 + b"}"), "nested too deeply"),
    "record-not-object": (lambda p: _build(p, _ssm_tensor([1, 2, 3])), "tensor record is list"),
    "record-number": (lambda p: _build(p, _ssm_tensor(7)), "tensor record is int"),
    "65-dims": (lambda p: _build(p, _ssm_tensor({"off": 0, "bytes": 4, "shape": [1] * 65,
                                                 "dtype": "float32", "hash": "0" * 16})),
                "65 dimensions"),
    "zero-size-2d": (lambda p: _build(p, _ssm_tensor({"off": 0, "bytes": 0, "shape": [0, 3],
                                                      "dtype": "float32", "hash": "0" * 16})),
                     "zero-size with 2 dimensions"),
    "dim-2**31": (lambda p: _build(p, _ssm_tensor({"off": 0, "bytes": 0, "shape": [0, 2**31],
                                                   "dtype": "float32", "hash": "0" * 16})),
                  ">= 2**31"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_is_one_error_line(tmp_path: Path, case: str) -> None:
    make, words = HOSTILE[case]
    f = make(tmp_path / f"{case}.kv")
    root = tmp_path / "root"
    assert run_here("init", "--root", root, "-q").code == 0
    assert_user_error(run_here("inspect", f), str(f), words)
    assert_user_error(run_here("inspect", f, "--json"), str(f), words)
    assert_user_error(run_here("import", f, "--root", root), str(f), words)
    assert run_here("ls", "--json", "--root", root).json()["entries"] == []


def test_hostile_files_in_a_fresh_process(tmp_path: Path) -> None:
    """The same, as a user runs it: no traceback from the deepest JSON or the 4 GiB header."""
    deep = HOSTILE["nested-200000"][0](tmp_path / "deep.kv")
    huge = _huge_header_length(tmp_path / "huge.kv")
    root = tmp_path / "root"
    assert run_here("init", "--root", root, "-q").code == 0
    runs = run_many([("inspect", deep), ("import", deep, "--root", root),
                     ("import", huge, "--root", root)])
    assert_user_error(runs[("inspect", str(deep))], "nested too deeply")
    assert_user_error(runs[("import", str(deep), "--root", str(root))], "nested too deeply")
    assert_user_error(runs[("import", str(huge), "--root", str(root))], "header length 4294967295")


def test_inspect_4_gib_header_length_is_a_truncation(tmp_path: Path) -> None:
    f = _huge_header_length(tmp_path / "huge.kv")
    r = run_here("inspect", f)
    assert r.code == 1 and r.out == "" and "Traceback" not in r.err
    assert r.err == (f"kvstore: {f}: truncated: header length 4294967295 runs past the end of "
                     f"the file: header would end at byte 4294967321, file is 32848 bytes\n")


@pytest.mark.parametrize("keep", [-10, -16384, 20000], ids=["last-bytes", "last-tensor", "mid"])
def test_inspect_reports_a_truncated_file(tmp_path: Path, keep: int) -> None:
    raw = (SAMPLES / "mixed.kv").read_bytes()
    f = tmp_path / "cut.kv"
    f.write_bytes(raw[:keep])
    r = run_here("inspect", f)
    assert r.code == 1, r
    assert "layers      4" in r.out  # what the header says is still shown
    assert r.err.startswith(f"kvstore: {f}: truncated: ") and r.err.count("\n") == 1, r.err
    d = run_here("inspect", f, "--json")
    assert d.code == 1 and "truncated" in d.json() and d.json()["header"]["caches"]
    whole = run_here("inspect", SAMPLES / "mixed.kv", "--json")
    assert whole.code == 0 and "truncated" not in whole.json()
