"""``ls``, ``show``, ``tree`` and ``stats`` on a root with checkpoints (issue 26): each is
shown as what it is (an entry, its depth in the prompt whose prefill saved it, that
prompt's conversation id), and ``stats`` counts them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from cli_helpers import NS_DEFAULT, T, run_here
from mlx_lm.models.cache import ArraysCache, KVCache

from kvstore import Store
from kvstore.mlx_lm.prefill import checkpoint_metadata

CONV = "0123456789abcdef"
STATE = 32 * 32 * 4


def _hybrid(tokens: list[int]) -> list[Any]:
    kv = KVCache()
    t = mx.array(tokens, dtype=mx.float16).reshape(1, 1, len(tokens), 1)
    kv.update_and_fetch(mx.broadcast_to(t, (1, 2, len(tokens), 8)),
                        mx.broadcast_to(-t, (1, 2, len(tokens), 8)))
    ssm = ArraysCache(1)
    ssm[0] = mx.full((1, 32, 32), float(len(tokens)))  # its own state at each depth
    return [kv, ssm]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("ckpt") / "root"
    prompt = list(range(2000, 2150))
    ids: dict[str, str] = {}
    with Store.open(path, block_tokens=T, durable=False) as s:
        for n in (64, 128):
            ids[f"c{n}"] = s.save(prompt[:n], _hybrid(prompt[:n]), namespace=NS_DEFAULT,
                                  priority="checkpoint", reuse_prefix=True,
                                  metadata=checkpoint_metadata(CONV, 150, 64)).id
        ids["user"] = s.save(prompt[:149], _hybrid(prompt[:149]), namespace=NS_DEFAULT,
                             priority="user", metadata={"cache_type": "user"}).id
    return path, ids


def test_ls_shows_what_each_checkpoint_is(root: tuple[Path, dict[str, str]]) -> None:
    path, ids = root
    r = run_here("ls", "--root", path, "--sort", "tokens")
    header, *lines = r.out.splitlines()
    assert header.split() == ["ID", "NAMESPACE", "TOKENS", "SIZE", "UNIQUE", "LAST", "ACCESS",
                              "HITS", "PRIORITY", "CHECKPOINT"]
    rows = {line.split()[0]: line for line in lines}
    assert re.search(r"\bcheckpoint\s+token 128 of 150 · conversation 0123456789abcdef$",
                     rows[ids["c128"][:12]])
    assert rows[ids["c64"][:12]].endswith("token 64 of 150 · conversation 0123456789abcdef")
    assert rows[ids["user"][:12]].rstrip().endswith("user")  # nothing in that column
    data = run_here("ls", "--root", path, "--json").json()
    by_id = {e["id"]: e for e in data["entries"]}
    assert by_id[ids["c64"]]["checkpoint"] == {"depth": 64, "conversation": CONV,
                                                "prompt_tokens": 150, "every": 64}
    assert by_id[ids["c64"]]["priority"] == "checkpoint"
    assert "checkpoint" not in by_id[ids["user"]]


def test_show_says_it_is_a_checkpoint(root: tuple[Path, dict[str, str]]) -> None:
    path, ids = root
    out = run_here("show", ids["c128"][:10], "--root", path).out
    assert ("checkpoint  token 128 of 150 · conversation 0123456789abcdef, one every 64 "
            "(thinned first by compact)\n") in out
    d = run_here("show", ids["c128"][:10], "--root", path, "--json").json()
    assert d["entry"]["checkpoint"]["depth"] == 128 and d["entry"]["priority"] == "checkpoint"
    user = run_here("show", ids["user"][:10], "--root", path).out
    assert "\ncheckpoint  " not in user


def test_tree_marks_checkpoints(root: tuple[Path, dict[str, str]]) -> None:
    path, ids = root
    out = run_here("tree", "--root", path).out
    assert re.search(r"3 entries \(2 checkpoints\) [·-] ", out), out
    for name, n in (("c64", 64), ("c128", 128)):
        assert re.search(rf"[◆+] {ids[name][:12]} \({n} tokens\) checkpoint$", out, re.M), out
    assert re.search(rf"{ids['user'][:12]} \(149 tokens\)", out)
    (t,) = run_here("tree", "--root", path, "--json").json()["namespaces"]
    assert sorted(t["checkpoints"]) == sorted([ids["c64"], ids["c128"]])


def test_stats_counts_checkpoints(root: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    path, _ = root
    d = run_here("stats", "--root", path, "--json").json()
    # each checkpoint's state is its own; their KV blocks the user entry shares
    assert d["entries"] == 3 and d["checkpoints"] == 2
    assert d["checkpoint_unique_bytes"] == 2 * STATE
    line = next(x for x in run_here("stats", "--root", path).out.splitlines()
                if x.startswith("checkpoints"))
    assert line.split() == ["checkpoints", "2", "of", "them,", "8.0", "KiB", "in", "blocks",
                            "only", "they", "hold", "(compact", "thins", "them", "first)"]
    run_here("init", "--root", tmp_path / "empty", "-q")
    empty = run_here("stats", "--root", tmp_path / "empty")
    assert not any(x.startswith("checkpoints") for x in empty.out.splitlines())
    assert run_here("stats", "--root", tmp_path / "empty", "--json").json()["checkpoints"] == 0
