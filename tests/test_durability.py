"""Issue 29, item 8: on macOS ``fsync`` does not flush the drive's cache; block files (and
the directories that name them, and exported files) are flushed with
``fcntl(F_FULLFSYNC)`` there, through the one helper ``kvstore._vio.full_fsync``."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from helpers.kv import NS, T, make_cache, tokens_for

import kvstore
from kvstore import _vio
from kvstore.local import blocks as local

F_FULLFSYNC = 51  # <sys/fcntl.h> on macOS


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every flush as ('fcntl', cmd) or ('fsync',), on a platform made to say darwin."""
    seen: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(_vio.sys, "platform", "darwin")
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", F_FULLFSYNC, raising=False)

    def fake_fcntl(fd: int, cmd: int, *args: object) -> int:
        assert cmd == F_FULLFSYNC
        seen.append("F_FULLFSYNC")
        real_fsync(fd)  # Linux has no F_FULLFSYNC: do the flush it stands for
        return 0

    def spy_fsync(fd: int) -> None:
        seen.append("fsync")
        real_fsync(fd)

    monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
    monkeypatch.setattr(_vio.os, "fsync", spy_fsync)
    return seen


def test_full_fsync_uses_f_fullfsync_on_darwin(tmp_path: Path, calls: list[str]) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        _vio.full_fsync(fd)
    finally:
        os.close(fd)
    assert calls == ["F_FULLFSYNC"]


def test_a_filesystem_that_refuses_it_gets_fsync(
    tmp_path: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(fd: int, cmd: int, *args: object) -> int:
        raise OSError(25, "Inappropriate ioctl for device")

    monkeypatch.setattr(fcntl, "fcntl", refuse)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        _vio.full_fsync(fd)
    finally:
        os.close(fd)
    assert calls == ["fsync"]


def test_linux_uses_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(_vio.sys, "platform", "linux")
    monkeypatch.setattr(_vio.os, "fsync", seen.append)
    _vio.full_fsync(7)
    assert seen == [7]


def test_a_durable_save_flushes_every_new_block_through_it(
    tmp_path: Path, calls: list[str]
) -> None:
    toks = tokens_for(4, 3 * T)
    with kvstore.Store.open(tmp_path / "r", namespace=NS, block_tokens=T, durable=True) as s:
        new_blocks = len(list(s.local.blocks.iter()))
        calls.clear()
        s.save(toks, make_cache(toks))
        new_blocks = len(list(s.local.blocks.iter())) - new_blocks
    assert new_blocks == 3
    # each block file, then its fan-out directory (one per distinct directory): all full
    assert calls and set(calls) == {"F_FULLFSYNC"}
    assert calls.count("F_FULLFSYNC") >= new_blocks
    assert local.full_fsync is _vio.full_fsync
