"""SIGKILL a save, a delete, an eviction or a compact at every crash point.

After the kill the root is reopened: verify passes (leftovers aside, which
repair removes), no manifest references a missing block, every committed entry
restores bit-exact and nothing uncommitted is visible.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.kv import make_cache, matches, open_store, run_worker, sound_store, tokens_for

import kvstore
from kvstore._crash import POINTS

A = (1, 100, 32)  # seed, tokens, shared prefix
B = (2, 80, 32)
C = (3, 120, 32)


def toks(spec: tuple[int, int, int]) -> list[int]:
    return tokens_for(*spec)


def exact(s: kvstore.Store, t: list[int]) -> bool:
    m = s.lookup(t)
    if m is None or m.length != len(t):
        return False
    cache, n = s.restore(t, verify=True)
    assert cache is not None and n == len(t) and matches(cache, t, n), "a restore was not exact"
    return True


def setup(root: Path, *, delete_a: bool = False, orphan: bool = False) -> str:
    with open_store(root) as s:
        for spec in (A, B):
            t = toks(spec)
            s.save(t, make_cache(t))
        m = s.lookup(toks(A))
        assert m is not None
        if delete_a:
            s.delete(m.entry_id)
        if orphan:
            s.local.blocks.put(kvstore.blocks.hash_bytes("blake3", b"orphan"), [b"orphan"])
        return m.entry_id


CASES: list[tuple[str, str, dict[str, Any], dict[str, bool]]] = [
    # (crash point, worker command, setup, after the crash: is A / C present?)
    ("after_block_write", "save", {}, {"A": True, "C": False}),
    ("before_commit", "save", {}, {"A": True, "C": False}),
    ("after_commit", "save", {}, {"A": True, "C": True}),
    ("delete_before_commit", "delete", {}, {"A": True, "C": False}),
    ("delete_before_commit", "evict", {}, {"A": True, "C": False}),
    ("gc_before_unlink", "evict", {}, {"A": False, "B": False, "C": False}),  # evictions committed
    ("gc_after_unlink", "evict", {}, {"A": False, "B": False, "C": False}),
    ("gc_before_unlink", "compact", {"delete_a": True}, {"A": False, "C": False}),
    ("gc_after_unlink", "compact", {"delete_a": True}, {"A": False, "C": False}),
    ("gc_before_unlink", "compact", {"orphan": True}, {"A": True, "C": False}),
    ("gc_after_unlink", "compact", {"orphan": True}, {"A": True, "C": False}),
]


def test_every_crash_point_is_covered() -> None:
    assert {c[0] for c in CASES} == set(POINTS)


@pytest.mark.parametrize(
    ("point", "op", "prep", "want"),
    CASES,
    ids=[f"{c[1]}-{c[0]}-{'-'.join(c[2]) or 'plain'}" for c in CASES],
)
def test_crash(
    tmp_path: Path, point: str, op: str, prep: dict[str, bool], want: dict[str, bool]
) -> None:
    root = tmp_path / "r"
    a_id = setup(root, **prep)
    args: dict[str, Any] = {"root": str(root)}
    if op == "save":
        cmd = "save"
        args.update(seed=C[0], n=C[1], shared=C[2])
    elif op == "delete":
        cmd = "delete"
        args.update(id=a_id)
    else:
        cmd = "compact"
        args.update(grace=0.0, max_bytes=0 if op == "evict" else None)
    rc, out, err = run_worker(cmd, args, crash_at=point)
    assert rc == -9, f"the worker was not killed at {point}: rc={rc} out={out} err={err}"

    with open_store(root) as s:
        sound_store(s)  # verify(read_data=True) passes; no manifest lacks a block
        assert exact(s, toks(A)) == want["A"]
        assert exact(s, toks(C)) == want["C"]
        assert exact(s, toks(B)) == want.get("B", True)
        # leftovers (orphans, zero records whose file went) go with repair
        s.verify(repair=True)
        assert s.verify(read_data=True).clean
        # and the store keeps working: save everything again, compact, restore
        for spec in (A, B, C):
            t = toks(spec)
            s.save(t, make_cache(t))
        s.compact(grace=0)
        for spec in (A, B, C):
            assert exact(s, toks(spec))
        sound_store(s)
