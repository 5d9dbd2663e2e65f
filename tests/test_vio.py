"""kvstore._vio: full positioned reads and writes through short transfers and EINTR."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore import _vio
from kvstore._vio import ShortReadError
from kvstore.errors import KVStoreError

DATA = bytes(range(256)) * 40  # 10240 bytes


@pytest.fixture
def fd(tmp_path: Path) -> Iterator[int]:
    p = tmp_path / "f"
    p.write_bytes(DATA)
    fd = os.open(p, os.O_RDWR)
    yield fd
    os.close(fd)


def _stingy(real: Callable[..., int], limit: int, eintr: list[int]) -> Callable[..., int]:
    """``real`` moving at most ``limit`` bytes a call, raising EINTR once first."""

    def call(fd: int, views: Sequence[memoryview], at: int) -> int:
        if not eintr:
            eintr.append(1)
            raise InterruptedError
        budget, cut = limit, []
        for v in views:
            v = v if v.format == "B" else v.cast("B")
            if budget <= 0:
                break
            cut.append(v[:budget] if v.nbytes > budget else v)
            budget -= cut[-1].nbytes
        return real(fd, cut, at)

    return call


def _views(sizes: Sequence[int]) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


@pytest.mark.parametrize("limit", [1, 7, 100, 1 << 20])
def test_preadv_all_fills_every_buffer_through_short_reads(
    fd: int, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "preadv", _stingy(os.preadv, limit, []))
    views = _views([3, 0, 250, 1, 4000])
    _vio.preadv_all(fd, views, 5)
    assert b"".join(bytes(v) for v in views) == DATA[5 : 5 + 4254]


def test_preadv_all_batches_more_buffers_than_iov_max(fd: int) -> None:
    views = _views([3] * (_vio.IOV_MAX * 2 + 5))
    _vio.preadv_all(fd, views, 1)
    assert b"".join(bytes(v) for v in views) == DATA[1 : 1 + 3 * len(views)]


@pytest.mark.parametrize("limit", [1, 64, 1 << 20])
def test_preadv_all_raises_at_the_end_of_the_file(
    fd: int, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "preadv", _stingy(os.preadv, limit, []))
    with pytest.raises(ShortReadError) as e:
        _vio.preadv_all(fd, _views([100, 200]), len(DATA) - 150)
    assert (e.value.offset, e.value.want, e.value.got) == (len(DATA) - 150, 300, 150)
    assert isinstance(e.value, KVStoreError) and isinstance(e.value, EOFError)
    assert f"150 of 300 bytes read at offset {len(DATA) - 150}" in str(e.value)


@pytest.mark.parametrize("limit", [1, 5, 1000, 1 << 20])
def test_pwritev_all_writes_every_byte_through_short_writes(
    fd: int, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "pwritev", _stingy(os.pwritev, limit, []))
    pieces = [memoryview(b"a" * 9), memoryview(b""), memoryview(b"bc" * 600)]
    _vio.pwritev_all(fd, pieces, 10)
    assert os.pread(fd, 1209, 10) == b"a" * 9 + b"bc" * 600
    assert os.pread(fd, 10, 0) == DATA[:10]


def test_pwritev_all_slices_bytes_of_a_wide_view(
    fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "pwritev", _stingy(os.pwritev, 3, [1]))
    wide = memoryview(bytearray(b"0123456789abcdef")).cast("I")  # 4 elements of 4 bytes
    _vio.pwritev_all(fd, [wide], 0)
    assert os.pread(fd, 16, 0) == b"0123456789abcdef"


def test_pwritev_all_refuses_to_spin(fd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    def nothing(*_: Any) -> int:
        return 0

    monkeypatch.setattr(os, "pwritev", nothing)
    with pytest.raises(OSError, match="wrote 0 bytes"):
        _vio.pwritev_all(fd, [memoryview(b"x")], 0)
