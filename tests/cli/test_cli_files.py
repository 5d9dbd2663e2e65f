"""export, inspect and import: mlx-bun cache files in and out of a root."""

from __future__ import annotations

import re
from pathlib import Path

from cli_helpers import MODEL, Root, assert_user_error, run, run_here, run_many


def test_export_inspect_import_round_trip(shared_root: Root, tmp_path: Path) -> None:
    a70 = shared_root.ids["a70"]
    v3, v5 = tmp_path / "a70.kv", tmp_path / "v5" / "a70.kv"
    v5.parent.mkdir()
    exported = run_many([
        ("export", a70[:8], v3, "--root", shared_root.path),
        ("export", a70, v5, "--format", "v5", "--json", "--root", shared_root.path),
    ])
    r = exported[("export", a70[:8], str(v3), "--root", str(shared_root.path))]
    assert r.code == 0 and r.err == ""
    assert re.fullmatch(rf"exported {a70[:12]} to {re.escape(str(v3))} \(v3, 70 tokens, "
                        r"[\d.]+ KiB\)\n", r.out)
    d = exported[("export", a70, str(v5), "--format", "v5", "--json", "--root",
                  str(shared_root.path))].json()
    assert d["id"] == a70 and d["format"] == "v5" and d["n_tokens"] == 70
    assert (v5.parent / "blocks").is_dir()

    target = tmp_path / "other"
    assert run_here("init", "--root", target, "--block-tokens", "16", "-q").code == 0
    seen = run_many([("inspect", v3), ("inspect", v5, "--json"),
                     ("import", v3, v5, "--root", target, "--json")])
    human = seen[("inspect", str(v3))]
    assert human.code == 0 and human.err == ""
    assert f"file        {v3} (" in human.out
    assert "mlx-bun formatVersion 3" in human.out and f"model       {MODEL}" in human.out
    assert "tokens      70: 1000 1001" in human.out and "layers      2" in human.out
    assert re.search(r"t0\s+float16\s+\[1, 2, 70, 8\]\s+2.2 KiB\s+@0", human.out)
    assert "tensor data 8.8 KiB in 4 tensors" in human.out
    info = seen[("inspect", str(v5), "--json")].json()
    assert info["format_version"] == 5 and info["header"]["modelId"] == MODEL
    assert re.fullmatch("[0-9a-f]{16}", info["header_hash"])
    assert info["data_start"] >= info["header_len"]
    assert all("blocks" in t for c in info["header"]["caches"] for t in c["tensors"])

    imp = seen[("import", str(v3), str(v5), "--root", str(target), "--json")]
    assert imp.code == 0, imp
    a, b = imp.json()["imported"]
    assert a["file"] == str(v3) and a["n_tokens"] == 70 and a["id"] == b["id"]
    assert b["new_bytes"] == 0  # the same entry twice: the second import is free
    human_import = run("import", v3, "--root", target)
    assert human_import.code == 0
    assert human_import.out == (f"already present: {v3} -> {a['id'][:12]} (70 tokens, 8.8 KiB)"
                                "\n")
    listed = run_here("ls", "--json", "--root", target).json()["entries"]
    assert [(e["id"], e["n_tokens"]) for e in listed] == [(a["id"], 70)]


def test_file_errors_are_user_errors(shared_root: Root, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("just some notes, not a cache\n" * 4)
    target = tmp_path / "t"
    run_here("init", "--root", target, "-q")
    runs = run_many([
        ("inspect", text),
        ("inspect", tmp_path / "absent.kv"),
        ("import", text, "--root", target),
        ("export", "beefbeef", tmp_path / "x.kv", "--root", shared_root.path),
    ])
    assert_user_error(runs[("inspect", str(text))], str(text), "not an mlx-bun KV file")
    assert_user_error(runs[("inspect", str(tmp_path / "absent.kv"))], "absent.kv",
                      "No such file")
    assert_user_error(runs[("import", str(text), "--root", str(target))], str(text))
    assert_user_error(runs[("export", "beefbeef", str(tmp_path / "x.kv"), "--root",
                            str(shared_root.path))], "beefbeef")
    assert_user_error(run_here("inspect", tmp_path), "is a directory")
    assert_user_error(run_here("import", tmp_path / "absent.kv", "--root", target),
                      "absent.kv", "no such file")
    assert_user_error(run_here("export", shared_root.ids["a40"], tmp_path / "y.kv",
                               "--format", "v4", "--root", shared_root.path), "--format")
    assert run_here("ls", "--json", "--root", target).json()["entries"] == []
