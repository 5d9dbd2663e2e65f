"""A restore runs no garbage collection of its own (kvstore.local.gcpause), and reads right."""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from helpers.kv import open_store
from mlx_lm.models.cache import KVCache

from kvstore.local import gcpause
from kvstore.local.reader import _Read

LAYERS, HEADS, DIM, TOKENS = 8, 8, 16, 512  # 32 blocks of 16 tokens: 4,096 row views
READER = os.path.join("kvstore", "local", "reader.py")


def _cache() -> list[Any]:
    out = []
    for i in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, HEADS, TOKENS, DIM), key=mx.random.key(i)).astype(mx.float16)
        v = mx.random.normal((1, HEADS, TOKENS, DIM), key=mx.random.key(99 + i)).astype(mx.float16)
        c.update_and_fetch(k, v)
        out.append(c)
    mx.eval([c.keys for c in out] + [c.values for c in out])
    return out


@pytest.fixture
def collections() -> Iterator[list[tuple[int, bool]]]:
    """Each collection that runs while the test does: its generation, and whether it started
    inside a restore's planning or reads (a frame of ``_materialize`` or of the reader)."""
    seen: list[tuple[int, bool]] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            f = sys._getframe(1)
            inside = False
            while f is not None:
                code = f.f_code
                if code.co_name == "_materialize" or code.co_filename.endswith(READER):
                    inside = True
                    break
                f = f.f_back
            seen.append((int(info["generation"]), inside))

    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


@pytest.mark.parametrize("verify", [True, False])
def test_restores_of_thousands_of_pieces_collect_nothing_while_they_read(
    tmp_path: Path, collections: list[tuple[int, bool]], verify: bool
) -> None:
    """Before the pause each of these restores ran young collections while it planned and
    read (about six each), and every few dozen restores a full one (generation 2), which
    walks every object of the process."""
    toks = list(range(1000, 1000 + TOKENS))
    cache = _cache()
    with open_store(tmp_path / "r") as s:
        s.save(toks, cache)
        assert gc.isenabled()
        gc.collect()
        collections.clear()
        for i in range(30):
            got, n = s.restore(toks, verify=verify)
            assert n == TOKENS and got is not None
            if i % 10 == 0:
                for a, b in zip(got, cache, strict=True):
                    assert mx.array_equal(a.keys[..., :TOKENS, :], b.keys[..., :TOKENS, :])
                    assert mx.array_equal(a.values[..., :TOKENS, :],
                                          b.values[..., :TOKENS, :])
            del got
        assert gc.isenabled()
    assert not [c for c in collections if c[1]], f"collections while reading: {collections}"
    assert not [c for c in collections if c[0] == 2], f"full collections: {collections}"


def test_a_collector_the_caller_disabled_stays_disabled(tmp_path: Path) -> None:
    toks = list(range(TOKENS))
    with open_store(tmp_path / "r") as s:
        s.save(toks, _cache())
        gc.disable()
        try:
            assert s.restore(toks)[1] == TOKENS
            assert not gc.isenabled()
        finally:
            gc.enable()


def test_overlapping_pauses_enable_the_collector_once_the_last_leaves() -> None:
    assert gc.isenabled()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with gcpause.paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with gcpause.paused():
        t.start()
        assert inside.wait(10)
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other restore is still in flight
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_a_pause_left_by_an_exception_enables_the_collector() -> None:
    with pytest.raises(RuntimeError), gcpause.paused():
        raise RuntimeError("a restore failed")
    assert gc.isenabled()


def test_a_read_sums_its_bytes_once() -> None:
    views = [memoryview(bytearray(n)) for n in (3, 5, 8)]
    r = _Read(0, views, 0, check=None)  # type: ignore[arg-type]
    assert r.nbytes == 16
    views.append(memoryview(bytearray(4)))  # a read's views are fixed when it is made
    assert r.nbytes == 16
