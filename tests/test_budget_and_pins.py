"""The budget bounds the root's bytes on disk, grace included, and keeps what a request has
just written (issue 36, item 6); cache breakpoints pin their entries until their TTL has
passed since their last use, within half the budget (issue 34, item 4)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from helpers.kv import (
    hybrid_cache,
    make_cache,
    matches,
    open_built,
    open_store,
    sound_store,
    tokens_for,
)

import kvstore
from kvstore.cli.main import cli
from kvstore.index import now_ms
from kvstore.local.gc import PIN_SHARE

BLOCK = 16 * 2 * 2 * 8 * 2  # one full token block of make_cache: 16 tokens, K+V, H2 D8 fp16


def on_disk(root: Path) -> int:
    """The bytes of the root's block files, as the file system has them."""
    return sum(f.stat().st_size for f in (root / "blocks").rglob("*") if f.is_file())


def test_the_budget_bounds_the_blocks_on_disk_and_keeps_the_latest_conversation(
    tmp_path: Path
) -> None:
    """A flood of conversations of a hybrid model (two checkpoints and the prompt's end each)
    under a budget with the default 600 s grace: after every save the block files hold at
    most the budget (the evicted blocks' grace gives way), and the last conversation's
    checkpoints are all still restored."""
    budget = 320 * 1024
    root = tmp_path / "r"
    s = open_store(root, max_bytes=budget)  # gc_grace: the default, 600 s
    convs = []
    for i in range(12):
        toks = tokens_for(i, 96)
        for n in (32, 64):
            s.save(toks[:n], hybrid_cache(toks[:n]), priority="checkpoint")
            assert on_disk(root) <= budget, (i, n)
        s.save(toks, hybrid_cache(toks))
        assert on_disk(root) == s.stats().physical_bytes <= budget, i
        convs.append(toks)
        time.sleep(0.002)
    assert s.stats().entries < 36  # it did evict
    last = convs[-1]
    for n in (32, 64):  # a prompt that parts from the last conversation after checkpoint n
        cache, got = s.restore([*last[:n], 99_999, 99_998])
        assert got == n and cache is not None
    sound_store(s)


def _skewed_store(root: Path, **kw: Any) -> tuple[kvstore.Store, list[int]]:
    """A store (as ``open_store`` opens it) that judges pins by a clock the test moves:
    the list's one item, in ms, added to the real time (``StoreOptions.clock``)."""
    skew = [0]
    return open_built(root, {"clock": lambda: now_ms() + skew[0]}, **kw), skew


def test_a_pinned_entry_outlives_a_flood_within_its_ttl_then_is_evicted(tmp_path: Path) -> None:
    """A system prompt pinned for 300 s outlives forty saves of its own priority under a budget
    of six entries and a compaction down to two; once 300 s have passed since its last use
    it is the least recently used entry, and the next save or compaction evicts it."""
    budget = 24 * BLOCK
    s, skew = _skewed_store(tmp_path / "r", max_bytes=budget)
    system = tokens_for(1000, 64)
    s.save(system, make_cache(system), priority="system", pin_ttl=300)

    def flood(seeds: range) -> None:
        for i in seeds:  # each 4 blocks: the budget holds 6 entries
            toks = tokens_for(i, 64)
            s.save(toks, make_cache(toks), priority="system")
            time.sleep(0.002)

    flood(range(40))
    cache, n = s.restore([*system, 5])  # a use: its TTL runs from now
    assert n == 64 and cache is not None and matches(cache, system, 64)
    s.flush_access()
    skew[0] = 299_000  # within 300 s of that use
    flood(range(40, 60))
    s.compact(max_bytes=8 * BLOCK, grace=0)  # the pin and the latest entry
    assert s.stats().entries == 2 and s.lookup([*system, 5]) is not None
    skew[0] = 301_000  # past it: an ordinary entry, the least recently used
    s.compact(max_bytes=4 * BLOCK, grace=0)
    assert s.lookup([*system, 5]) is None and s.stats().entries == 1
    sound_store(s)


def test_the_budget_after_a_save_evicts_an_expired_pin_first(tmp_path: Path) -> None:
    budget = 24 * BLOCK
    s, skew = _skewed_store(tmp_path / "r", max_bytes=budget)
    system = tokens_for(1000, 64)
    s.save(system, make_cache(system), priority="system", pin_ttl=60)
    for i in range(12):
        toks = tokens_for(i, 64)
        s.save(toks, make_cache(toks), priority="system")
    assert s.lookup([*system, 5]) is not None
    skew[0] = 61_000
    toks = tokens_for(12, 64)
    s.save(toks, make_cache(toks), priority="system")
    assert s.lookup([*system, 5]) is None
    sound_store(s)


def test_pins_alone_never_take_the_root_over_its_budget(tmp_path: Path) -> None:
    """Every entry pinned for an hour, 4 blocks each, no block shared: the pins beyond
    half the budget are ordinary entries, evicted least recently used first, so the root
    holds exactly the most recent budget // entry bytes of them after every save, and the
    evicted blocks' grace fills the rest of the budget, no more."""
    budget = 26 * BLOCK  # 6 entries and a half
    root = tmp_path / "r"
    s = open_store(root, max_bytes=budget)
    saved = []
    for i in range(20):
        toks = tokens_for(i, 64)
        s.save(toks, make_cache(toks), priority="system", pin_ttl=3600)
        saved.append(toks)
        time.sleep(0.002)
        live = s.local.index.totals().live_bytes
        assert live == min(i + 1, 6) * 4 * BLOCK  # the live entries: 6 fit
        assert on_disk(root) == min((i + 1) * 4 * BLOCK, budget)  # the rest: grace, pressed
    assert [t for t in saved if s.lookup([*t, 1]) is not None] == saved[-6:]
    # a compaction to a smaller budget keeps the pins that fit in its share, the most recent
    s.compact(max_bytes=16 * BLOCK, grace=0)
    kept = [t for t in saved if s.lookup([*t, 1]) is not None]
    assert int(16 * BLOCK * PIN_SHARE) == 8 * BLOCK
    assert kept == saved[-4:]  # 2 pinned (8 blocks) + 2 ordinary, the most recent, in 16
    sound_store(s)


def test_ls_json_shows_a_pin(tmp_path: Path) -> None:
    s = open_store(tmp_path / "r")
    pinned, plain = tokens_for(1, 40), tokens_for(2, 40)
    a = s.save(pinned, make_cache(pinned), priority="system", pin_ttl=3600)
    s.save(plain, make_cache(plain))
    s.close()
    out = CliRunner().invoke(cli, ["--root", str(tmp_path / "r"), "ls", "--json"])
    assert out.exit_code == 0, out.output
    got = {e["id"]: e for e in json.loads(out.output)["entries"]}
    assert got[a.id]["pin"] == {"ttl": 3600.0, "until": got[a.id]["last_access"] + 3_600_000}
    assert [e.get("pin") for i, e in got.items() if i != a.id] == [None]
