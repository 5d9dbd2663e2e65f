"""ls, show, stats and tree on a populated root: human output, --json, exit status."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_helpers import MODEL, Result, Root, T, assert_user_error, run_here, run_many

import kvstore

Runs = dict[tuple[str, ...], Result]


@pytest.fixture(scope="module")
def runs(shared_root: Root) -> Runs:
    r = str(shared_root.path)
    a40 = shared_root.ids["a40"]
    return run_many([
        ("ls", "--root", r),
        ("ls", "--root", r, "--json"),
        ("show", a40[:8], "--root", r),
        ("show", a40[:8], "--root", r, "--json"),
        ("stats", "--root", r),
        ("stats", "--root", r, "--json"),
        ("tree", "--root", r),
        ("tree", "--root", r, "--json"),
    ])


def _ls_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    return [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]


def test_ls_human_lists_every_entry_in_aligned_columns(runs: Runs, shared_root: Root) -> None:
    r = runs[("ls", "--root", str(shared_root.path))]
    assert r.code == 0 and r.err == ""
    header, *lines = r.out.splitlines()
    assert header.split() == ["ID", "NAMESPACE", "TOKENS", "SIZE", "UNIQUE", "LAST", "ACCESS",
                              "HITS", "PRIORITY"]
    assert len(lines) == len(shared_root.ids)
    # right-aligned numeric columns end at the same column as their header
    end = header.index("TOKENS") + len("TOKENS")
    assert all(line[end - 1] != " " and line[end] == " " for line in lines)
    rows = {row[0]: row for row in _ls_rows(r.out)}
    a40 = rows[shared_root.ids["a40"][:12]]
    assert a40[1] == f"{MODEL}/default" and a40[2] == "40"
    assert a40[3] == "5.0 KiB"  # 40 tokens x 2 layers x (K+V) x 2 heads x 8 dims x fp16
    assert a40[4] == "1.0 KiB"  # its partial last block (tokens 32-40) is its own
    assert a40[5] == "just now" and a40[6] == "0" and a40[7] == "system"


def test_ls_json_has_the_documented_fields(runs: Runs, shared_root: Root) -> None:
    r = runs[("ls", "--root", str(shared_root.path), "--json")]
    assert r.code == 0
    data = r.json()
    assert data["root"] == str(shared_root.path)
    by_id = {e["id"]: e for e in data["entries"]}
    assert set(by_id) == set(shared_root.ids.values())
    e = by_id[shared_root.ids["a64"]]
    assert set(e) == {"id", "namespace", "n_tokens", "logical_bytes", "unique_bytes",
                      "created_at", "last_access", "hits", "priority"}
    assert e["namespace"] == {"model_id": MODEL, "config_fingerprint": "cfg",
                              "tokenizer_hash": "tok", "ns": "default"}
    assert e["n_tokens"] == 64 and e["logical_bytes"] == 64 * 128
    assert e["unique_bytes"] == 0  # all four of its blocks are shared with a70/a90
    assert by_id[shared_root.ids["a90"]]["unique_bytes"] == 2 * 16 * 128 - 6 * 128
    g = by_id[shared_root.ids["g20"]]
    assert g["unique_bytes"] == g["logical_bytes"] == 20 * 64


@pytest.mark.parametrize("key,column", [("tokens", 2), ("hits", 6)])
def test_ls_sorts_largest_first(shared_root: Root, key: str, column: int) -> None:
    r = run_here("ls", "--root", shared_root.path, "--sort", key)
    values = [int(row[column]) for row in _ls_rows(r.out)]
    assert values == sorted(values, reverse=True)
    rev = run_here("ls", "--root", shared_root.path, "--sort", key, "--reverse")
    assert [int(row[column]) for row in _ls_rows(rev.out)] == sorted(values)


def test_ls_sort_by_size_and_created(shared_root: Root) -> None:
    by_size = run_here("ls", "--root", shared_root.path, "--sort", "size", "--json").json()
    sizes = [e["logical_bytes"] for e in by_size["entries"]]
    assert sizes == sorted(sizes, reverse=True)
    by_created = run_here("ls", "--root", shared_root.path, "--sort", "created", "--json").json()
    stamps = [e["created_at"] for e in by_created["entries"]]
    assert stamps == sorted(stamps, reverse=True)


def test_ls_namespace_filter(shared_root: Root) -> None:
    r = run_here("ls", "--root", shared_root.path, "--namespace", f"{MODEL}/other", "--json")
    assert [e["id"] for e in r.json()["entries"]] == [shared_root.ids["o48"]]
    r = run_here("ls", "--root", shared_root.path, "--namespace", MODEL, "--json")
    assert len(r.json()["entries"]) == 5  # a model id alone matches all of its namespaces
    r = run_here("ls", "--root", shared_root.path, "--namespace", "nobody")
    assert r.code == 0 and r.out.strip() == "no entries in namespace 'nobody'"


def test_ls_bad_sort_key_is_a_user_error(shared_root: Root) -> None:
    assert_user_error(run_here("ls", "--root", shared_root.path, "--sort", "colour"), "--sort")


def test_show_human_prints_the_manifest(runs: Runs, shared_root: Root) -> None:
    a40 = shared_root.ids["a40"]
    r = runs[("show", a40[:8], "--root", str(shared_root.path))]
    assert r.code == 0 and r.err == ""
    out = r.out
    assert f"entry       {a40}\n" in out
    assert f"namespace   {MODEL}/default\n" in out
    assert "  config    cfg\n" in out and "  tokenizer tok\n" in out
    assert f"kvstore-mlx/1, blake3, {T} tokens per block" in out
    assert "tokens      40: 1000 1001 1002" in out and "… (+24)" in out
    assert "layers      2\n" in out
    assert re.search(r"^\s+0-1\s+kv\s+offset=40$", out, re.M)  # identical: one run
    assert re.search(r"t0\s+float16\s+\[1, 2, 40, 8\]\s+token axis 2", out)
    assert "token blocks 3\n" in out and "shared by 5" in out and "unique" in out
    assert "priority system" in out
    assert re.search(r"^metadata\n  purpose  chat$", out, re.M)


def test_show_json_is_the_manifest(runs: Runs, shared_root: Root) -> None:
    a40 = shared_root.ids["a40"]
    d = runs[("show", a40[:8], "--root", str(shared_root.path), "--json")].json()
    assert d["id"] == a40 and d["n_tokens"] == 40 and d["block_tokens"] == T
    assert d["tokens"] == list(range(1000, 1032)) + list(range(8))
    assert d["layers"][0] == {
        "kind": "kv", "offset": 40,
        "tensors": [{"shape": [1, 2, 40, 8], "dtype": "float16", "token_axis": 2,
                     "state_offset": None}] * 2,
    }
    assert [b["bytes"] for b in d["token_blocks"]] == [2048, 2048, 1024]
    assert [b["refcount"] for b in d["token_blocks"]] == [5, 5, 1]
    assert all(re.fullmatch("[0-9a-f]{64}", b["digest"]) for b in d["token_blocks"])
    assert d["metadata"] == {"purpose": "chat"}
    assert d["entry"]["unique_bytes"] == 1024 and d["entry"]["priority"] == "system"


def test_show_accepts_a_full_id_and_prints_all_tokens(shared_root: Root) -> None:
    a90 = shared_root.ids["a90"]
    r = run_here("show", a90, "--root", shared_root.path, "--tokens")
    assert r.code == 0
    assert "tokens      90: 1000 1001" in r.out and " 56 57\n" in r.out and "…" not in r.out


@pytest.mark.parametrize("bad", ["ffff", "xyz!", "12", "f" * 64])
def test_show_unknown_entry_is_a_user_error(shared_root: Root, bad: str) -> None:
    assert_user_error(run_here("show", bad, "--root", shared_root.path))


def test_stats_human_and_json(runs: Runs, shared_root: Root) -> None:
    r = runs[("stats", "--root", str(shared_root.path))]
    assert r.code == 0 and r.err == ""
    assert re.search(r"^entries\s+6$", r.out, re.M)
    assert re.search(r"^dedup\s+\d+\.\d\dx \(saves [\d.]+ KiB\)$", r.out, re.M)
    assert re.search(rf"^settings\s+blake3, {T} tokens per block", r.out, re.M)
    assert re.search(r"^tokens saved\s+no requests recorded$", r.out, re.M)
    assert re.search(r"^store lookups\s+none recorded$", r.out, re.M)
    d = runs[("stats", "--root", str(shared_root.path), "--json")].json()
    assert d["entries"] == 6 and d["hash"] == "blake3" and d["block_tokens"] == T
    assert d["logical_bytes"] == (40 + 64 + 70 + 90 + 48) * 128 + 20 * 64
    assert d["physical_bytes"] < d["logical_bytes"]
    assert d["dedup_ratio"] == pytest.approx(d["logical_bytes"] / d["physical_bytes"])
    assert d["hit_rate"] is None and d["budget_bytes"] is None
    assert d["requests"]["lifetime"]["requests"] == 0 and d["reset"] is False
    assert d["requests"]["lifetime"]["tokens_saved_share"] is None
    assert d["unreferenced_blocks"] == 0


def test_tree_human_shows_the_shared_system_prompt(runs: Runs, shared_root: Root) -> None:
    r = runs[("tree", "--root", str(shared_root.path))]
    assert r.code == 0 and r.err == ""
    ids = shared_root.ids
    out = r.out
    assert f"{MODEL}/default  4 entries" in out
    assert "└─ tokens 0–32 · 2 blocks · 4.0 KiB · shared by 4 entries" in out
    assert "tokens 32–64 · 2 blocks · 4.0 KiB · shared by 3 entries" in out
    assert f"● {ids['a64'][:12]} (64 tokens) ends here" in out
    assert f"tokens 64–90 · 2 blocks · 3.2 KiB · {ids['a90'][:12]} (90 tokens)" in out
    assert f"tokens 32–40 · 1 block · 1.0 KiB · {ids['a40'][:12]} (40 tokens)" in out
    assert f"{MODEL}/other  1 entry" in out and "tiny/gemma/default  1 entry" in out


def test_tree_json(runs: Runs, shared_root: Root) -> None:
    d = runs[("tree", "--root", str(shared_root.path), "--json")].json()
    trees = {(t["namespace"]["model_id"], t["namespace"]["ns"]): t for t in d["namespaces"]}
    t = trees[(MODEL, "default")]
    assert t["entries"] == 4
    assert t["referenced_bytes"] == (40 + 64 + 70 + 90) * 128
    assert t["saved_bytes"] == t["referenced_bytes"] - t["stored_bytes"] > 0
    (top,) = t["branches"]
    assert (top["start_token"], top["tokens"], top["blocks"]) == (0, 32, 2)
    assert sorted(top["entries"]) == sorted(shared_root.ids[k] for k in ("a40", "a64", "a70",
                                                                          "a90"))
    mid = next(c for c in top["children"] if len(c["entries"]) == 3)
    assert mid["ends"] == [shared_root.ids["a64"]]
    assert {c["tokens"] for c in mid["children"]} == {6, 26}


def test_commands_do_not_create_a_root(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    runs = run_many([(c, "--root", missing) for c in ("ls", "stats", "tree", "verify")]
                    + [("show", "abcd", "--root", missing)])
    for r in runs.values():
        assert_user_error(r, str(missing), "not a kvstore root", "kvstore init")
    assert not missing.exists()


def test_stats_shows_the_requests_by_tier_and_reset_starts_them_anew(tmp_path: Path) -> None:
    """Issue 28: tokens saved is the headline; each tier's requests and tokens, over the
    root's lifetime and, after --reset, since then."""
    from kvstore import Store

    root = tmp_path / "root"
    with Store.open(root, block_tokens=T) as s:
        s.note_request(571, 570, "local")
        s.note_request(300, 250, "memory")
        s.note_request(100, 0, miss="no_entry")
    r = run_here("stats", "--root", root)
    assert r.code == 0 and r.err == ""
    assert re.search(r"^tokens saved\s+84\.4% \(820 of 971 prompt tokens\)$", r.out, re.M)
    assert re.search(r"^  from memory\s+1 request, 250 tokens$", r.out, re.M), r.out
    assert re.search(r"^  from local\s+1 request, 570 tokens$", r.out, re.M)
    assert re.search(r"^  computed\s+151 tokens$", r.out, re.M)
    assert re.search(r"^  miss reasons\s+no_entry 1$", r.out, re.M)
    assert "since reset" not in r.out
    r = run_here("stats", "--root", root, "--reset", "--json")
    d = r.json()
    assert d["reset"] is True and d["requests"]["since_reset"]["requests"] == 3
    with Store.open(root) as s:
        s.note_request(200, 150, "remote")
    d = run_here("stats", "--root", root, "--json").json()["requests"]
    assert d["reset_at"] is not None and d["since_reset"]["since"] == d["reset_at"]
    assert (d["lifetime"]["requests"], d["since_reset"]["requests"]) == (4, 1)
    assert d["since_reset"]["tiers"]["remote"] == {"requests": 1, "tokens": 150}
    assert d["since_reset"]["tiers"]["local"] == {"requests": 0, "tokens": 0}
    assert d["lifetime"]["tiers"]["local"] == {"requests": 1, "tokens": 570}
    r = run_here("stats", "--root", root)
    assert re.search(r"^  from remote\s+1 request, 150 tokens\s+1 request, 150 tokens$",
                     r.out, re.M), r.out
    assert re.search(r"^requests\s+lifetime \(since .*\)\s+since reset \(just now\)$",
                     r.out, re.M), r.out


def test_ls_and_tree_read_in_batches_print_what_one_batch_prints(
    shared_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ls and tree read the manifests a batch at a time (issue 29: 100k entries); with
    batches of 2 their text and JSON are those of a single batch, byte for byte."""
    from kvstore.cli import commands_view

    cmds = [(c, *a) for c in ("ls", "tree") for a in ((), ("--json",))]
    whole = {c: run_here(*c, "--root", shared_root.path) for c in cmds}
    monkeypatch.setattr(commands_view, "_BATCH", 2)
    for c, r in whole.items():
        again = run_here(*c, "--root", shared_root.path)
        assert r.code == 0 and again.code == 0 and again.out == r.out, c
    assert "shared by" in whole[("tree",)].out
    data = whole[("ls", "--json")].json()
    assert whole[("ls", "--json")].out == json.dumps(data, indent=2) + "\n"  # emit's layout
    assert len(data["entries"]) == len(shared_root.ids) > 2
    assert len(whole[("ls",)].out.splitlines()) == len(shared_root.ids) + 1


# --- issue 38, item 15: identical layers once; the tokens as text --------------------------


@pytest.fixture
def tiny_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str, Path, str]:
    """A root holding one entry of 30 identical layers, saved in the namespace of a tiny
    model that ``kvstore model fetch``'s model cache holds; (root, id, model dir, text)."""
    from helpers.kv import make_cache
    from tokenizers import Tokenizer

    from kvstore.mlx_lm import namespace_for_path
    from kvstore.tiny import make_tiny_model

    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = make_tiny_model(tmp_path / "models" / "tiny-llama", "llama")
    text = "The river ran past the old mill.\nThe miller slept."
    tokens = Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids
    root = tmp_path / "root"
    with kvstore.Store.open(root, namespace=namespace_for_path(model), block_tokens=16) as s:
        info = s.save(tokens, [c for _ in range(30) for c in make_cache(tokens)])
    return root, info.id, model, text


def test_show_prints_identical_layers_once_under_their_range(
    tiny_entry: tuple[Path, str, Path, str],
) -> None:
    root, eid, _, _ = tiny_entry
    r = run_here("show", eid, "--root", root)
    assert r.code == 0, r
    lines = r.out.splitlines()
    at = lines.index("layers      30")
    n = len(run_here("show", eid, "--root", root, "--json").json()["tokens"])
    assert lines[at + 1:at + 4] == [
        f"  0-29  kv       offset={n}",
        f"          t0  float16  [1, 2, {n}, 8]{' ' * (18 - len(f'[1, 2, {n}, 8]'))} token axis 2",
        f"          t1  float16  [1, 2, {n}, 8]{' ' * (18 - len(f'[1, 2, {n}, 8]'))} token axis 2",
    ]
    assert lines[at + 4].startswith("token blocks ")


def test_show_text_decodes_the_tokens_with_the_models_tokenizer(
    tiny_entry: tuple[Path, str, Path, str],
) -> None:
    root, eid, model, text = tiny_entry
    r = run_here("show", eid, "--root", root, "--text")
    assert r.code == 0, r
    lines = r.out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("tokens "))
    assert lines[at + 1:at + 4] == [f"text        decoded by the tokenizer in {model}",
                                    "  The river ran past the old mill.",
                                    "  The miller slept."]
    d = run_here("show", eid, "--root", root, "--text", "--json").json()
    assert d["text"] == {"tokenizer": str(model), "text": text}
    # --model names it; another model's tokenizer is refused
    assert run_here("show", eid, "--root", root, "--text", "--model", model).out == r.out


def test_show_text_without_the_tokenizer_is_one_line(
    tiny_entry: tuple[Path, str, Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, eid, model, _ = tiny_entry
    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path / "elsewhere"))
    r = run_here("show", eid, "--root", root, "--text")
    assert_user_error(r)
    assert r.err == ("kvstore: error: --text: the tokenizer of model 'tiny-llama' is not on "
                     "this machine (not in the model cache nor the Hugging Face cache); "
                     "--model DIR names its directory\n")
    from kvstore.tiny import make_tiny_model

    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=300)
    r = run_here("show", eid, "--root", root, "--text", "--model", other)
    assert r.err == (f"kvstore: error: --model {other}: its tokenizer is not the one this "
                     "entry was saved with (model tiny-llama)\n")
