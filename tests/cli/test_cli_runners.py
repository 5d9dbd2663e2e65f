"""demo, bench and serve: the commands that run a model, a benchmark or a server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_helpers import assert_user_error, run, run_here, run_many


def test_demo_fills_the_root_and_reuses_it_from_a_second_process(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    r = run("demo", "--root", root)
    assert r.code == 0, r
    assert f"cache root {root}" in r.out
    assert re.search(r"^2nd process .* reused\s+[1-9]\d* \(disk", r.out, re.M)
    entries = run_here("ls", "--json", "--root", root).json()["entries"]
    assert entries and all(e["namespace"]["model_id"] == "tiny-llama" for e in entries)


@pytest.mark.slow
def test_demo_without_root_uses_a_root_of_its_own_and_says_how_to_remove_it(
    tmp_path: Path,
) -> None:
    """Issue 38, item 14: the demo wrote its tiny-model entries into the user's own root."""
    mine = tmp_path / "my-root"
    r = run("demo", env={"KVSTORE_ROOT": str(mine), "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.code == 0, r
    own = tmp_path / "cache" / "kvstore-demo"
    lines = r.out.splitlines()
    assert lines[1] == (f"cache root {own} (the demo's own, not your default root; --root DIR "
                        "chooses another)")
    assert lines[-1] == (f"the demo's entries stay in {own}: 'kvstore --root {own} ls' (or "
                         f"tree) shows them, 'rm -r {own}' removes them")
    assert not mine.exists()
    assert len(run_here("ls", "--json", "--root", own).json()["entries"]) == 7


def test_bench_smoke_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = run("bench", "--config", "smoke", "--only", "lookup", "--json", out,
            "--scratch", tmp_path / "scratch")
    assert r.code == 0, r
    assert "kvstore bench (smoke)" in r.out
    data = json.loads(out.read_text())
    assert data  # the benchmark's own schema; the CLI only passes the file on
    bad = run_here("bench", "--only", "nothing")
    assert bad.code == 2


def test_serve_help_lists_kvstore_and_mlx_lm_options() -> None:
    r = run("serve", "--help")
    assert r.code == 0, r
    for opt in ("--root", "--max-bytes", "--min-tokens", "--namespace"):
        assert opt in r.out
    assert "--model" in r.out and "--port" in r.out  # mlx_lm.server's own


def test_serve_help_has_one_usage_line_as_every_command_does() -> None:
    """Issue 27, item 13: not argparse's two usage blocks, one per option set."""
    r = run("serve", "--help")
    assert r.code == 0, r
    lines = r.out.splitlines()
    assert lines[0] == "Usage: kvstore serve [OPTIONS] [MLX_LM_SERVER_OPTIONS]..."
    assert [line for line in lines if line.lower().startswith("usage:")] == [lines[0]]
    assert lines.index("kvstore options:") < lines.index("mlx_lm.server options:")
    ours = lines[lines.index("kvstore options:"):lines.index("mlx_lm.server options:")]
    assert any(line.startswith("  --root DIR ") for line in ours)
    assert not any("--port" in line for line in ours)


def test_serve_rejects_a_bad_budget_without_starting() -> None:
    r = run("serve", "--max-bytes", "lots")
    assert r.code == 2
    assert "lots" in r.err and "Traceback" not in r.err


def test_an_unknown_command_is_a_user_error() -> None:
    assert_user_error(run_here("frobnicate"), "No such command 'frobnicate'", "kvstore --help")


def test_demo_with_a_model_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    """Issue 38, item 5: ``demo --model /tmp/nope`` printed a 42-line HFValidationError."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = {"nope": "no such model directory (give smollm2 or an mlx-lm model directory)",
             "file": "not a model directory", "empty": "not a model directory (no config.json)"}
    got = run_many([("demo", "--root", str(tmp_path / "root"), "--model", str(tmp_path / n))
                    for n in cases])
    for name, why in cases.items():
        r = got[("demo", "--root", str(tmp_path / "root"), "--model", str(tmp_path / name))]
        assert (r.code, r.out, r.err) == (2, "", f"kvstore: error: --model {tmp_path / name}: "
                                                 f"{why}\n"), r
    assert not (tmp_path / "root").exists()
