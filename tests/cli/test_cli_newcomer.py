"""Issue 12, "the newcomer's path": the command line's rough edges (items 7, 8 and 9)."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from cli_helpers import NS_DEFAULT, Root, assert_user_error, kv_cache, run, run_here

from kvstore import Store

DATA = Path(__file__).resolve().parents[1] / "data" / "mlx-bun-v3"


def _bad_file(tmp_path: Path) -> Path:
    """The first bytes of a real file: its header is cut short."""
    bad = tmp_path / "bad.kv"
    bad.write_bytes((DATA / "tiny.kv").read_bytes()[:100])
    return bad


# --- item 7: import reports every file's outcome --------------------------------------------


def test_import_reports_each_file_then_fails(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run_here("init", "--root", root, "-q").code == 0
    good, bad = tmp_path / "a.kv", _bad_file(tmp_path)
    shutil.copy(DATA / "tiny.kv", good)
    r = run("import", good, bad, good, tmp_path / "absent.kv", "--root", root)
    assert r.code == 2, r
    out = r.out.splitlines()
    assert len(out) == 2, r.out
    assert re.fullmatch(rf"imported {re.escape(str(good))} -> [0-9a-f]{{12}} \(5 tokens, .*\)",
                        out[0])
    eid = out[0].split(" -> ")[1][:12]
    assert re.fullmatch(rf"already present: {re.escape(str(good))} -> {eid}\b.*", out[1])
    err = r.err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("kvstore: error: ") for e in err), r.err
    assert str(bad) in err[0] and "absent.kv" in err[1] and "no such file" in err[1]
    assert "Traceback" not in r.err
    listed = run_here("ls", "--json", "--root", root).json()["entries"]
    assert [e["id"][:12] for e in listed] == [eid]

    d = run("import", good, bad, "--json", "--root", root)
    assert d.code == 2 and str(bad) in d.err
    doc = d.json()
    assert [(f["file"], f["status"]) for f in doc["imported"]] == [(str(good), "present")]
    assert doc["imported"][0]["id"].startswith(eid)
    (failed,) = doc["failed"]
    assert failed["file"] == str(bad) and failed["error"]


# --- item 8: compact and stats say what the grace holds back ---------------------------------



def test_compact_reports_the_bytes_the_grace_holds_back(fresh_root: Root) -> None:
    root = fresh_root.path
    t0 = time.time() * 1000
    r = run("compact", "--max-bytes", "1K", "--root", root)
    assert r.code == 0, r
    assert re.search(r"^evicted\s+6$", r.out, re.M), r.out
    (held,) = [line for line in r.out.splitlines() if line.startswith("held back")]
    assert "KiB in" in held and "blocks" in held and "600 s grace" in held, held
    assert "--grace 0" in held, held
    d = run("compact", "--dry-run", "--json", "--root", root).json()["report"]
    assert d["freed_bytes"] == 0 and d["held_blocks"] > 0 and d["held_bytes"] > 0
    assert t0 + 600_000 <= d["held_until"] <= time.time() * 1000 + 600_000
    done = run("compact", "--grace", "0", "--json", "--root", root).json()["report"]
    assert done["freed_bytes"] == d["held_bytes"] and done["held_bytes"] == 0
    assert done["held_until"] is None



def test_stats_does_not_promise_what_only_grace_zero_frees(fresh_root: Root) -> None:
    root = fresh_root.path
    run_here("rm", fresh_root.ids["a90"], "--root", root)
    r = run_here("stats", "--root", root)
    (line,) = [line for line in r.out.splitlines() if line.startswith("unreferenced")]
    assert "freed by 'kvstore compact" not in line
    assert "600 s grace" in line and "--grace 0" in line, line
    d = run_here("stats", "--json", "--root", root).json()
    assert d["unreferenced_held_bytes"] == d["unreferenced_bytes"] > 0
    assert d["unreferenced_held_until"] > time.time() * 1000


# --- item 9: the smaller ones ----------------------------------------------------------------



def test_reimport_after_rm_gives_the_same_id(tmp_path: Path) -> None:
    root = tmp_path / "root"
    run_here("init", "--root", root, "-q")
    ids = []
    for _ in range(3):
        (imp,) = run_here("import", DATA / "tiny.kv", "--json", "--root", root).json()["imported"]
        ids.append(imp["id"])
        assert run_here("rm", imp["id"], "--root", root, "-q").code == 0
        time.sleep(0.01)  # a new millisecond: the id must not hang on the clock
    assert len(set(ids)) == 1



def test_metadata_and_cache_type_survive_export_and_import(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    with Store.open(src, block_tokens=16, durable=False) as s:
        eid = s.save(list(range(40)), kv_cache(40), namespace=NS_DEFAULT, priority="user",
                     metadata={"cache_type": "user", "purpose": "chat"}).id
    run_here("init", "--root", dst, "--block-tokens", "16", "-q")
    for fmt in ("v3", "v5"):
        out = tmp_path / fmt / "e.kv"
        out.parent.mkdir()
        assert run_here("export", eid, out, "--format", fmt, "--root", src).code == 0
        (imp,) = run_here("import", out, "--json", "--root", dst).json()["imported"]
        shown = run_here("show", imp["id"], "--json", "--root", dst).json()
        meta = shown["metadata"]
        assert (meta["cache_type"], meta["purpose"]) == ("user", "chat"), meta
        assert shown["entry"]["priority"] == "user"
        assert run_here("rm", imp["id"], "--root", dst, "-q").code == 0



def test_entry_id_errors_read_well(shared_root: Root) -> None:
    root = shared_root.path
    assert_user_error(run_here("show", "ffffff", "--root", root), "no entry matches 'ffffff'")
    short = run_here("show", "abc", "--root", root)
    assert_user_error(short, "'abc'", "too short", "at least 4")



def test_init_on_an_existing_root_reads_well(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run_here("init", "--root", root).out.startswith("Created kvstore root at")
    assert run_here("init", "--root", root).out.startswith(f"kvstore root already exists at {root}")



def test_an_emptied_root_reads_dedup_as_a_fresh_one(fresh_root: Root, tmp_path: Path) -> None:
    root = fresh_root.path
    assert run_here("rm", *fresh_root.ids.values(), "--root", root, "-q").code == 0
    fresh = tmp_path / "fresh"
    run_here("init", "--root", fresh, "-q")

    def dedup(r: Path) -> tuple[str, float]:
        text = run_here("stats", "--root", r).out
        (line,) = [x for x in text.splitlines() if x.startswith("dedup")]
        return line, run_here("stats", "--json", "--root", r).json()["dedup_ratio"]

    assert dedup(root) == dedup(fresh)



def test_bench_help_lists_only_the_options_it_uses() -> None:
    r = run_here("bench", "--help")
    assert r.code == 0
    for used in ("--quick", "--json", "--config", "--only", "--scratch"):
        assert used in r.out, used
    for unused in ("--root", "--quiet"):
        assert unused not in r.out, unused
    from kvstore.bench.common import CONFIGS
    from kvstore.cli.main import BENCH_CONFIGS

    assert sorted(BENCH_CONFIGS) == sorted(CONFIGS)



def test_bench_progress_lines_use_human_units(tmp_path: Path) -> None:
    r = run("bench", "--config", "smoke", "--only", "save,multiturn", "--scratch", tmp_path)
    assert r.code == 0, r
    rows = [line for line in r.out.splitlines() if line.startswith("  ") and "kvstore" in line]
    assert rows, r.out
    for line in rows:
        assert not re.search(r"\de[+-]\d", line), line
        assert re.search(r"\d (ms|s|µs|B|KiB|MiB|GiB)\b", line), line
    assert any(re.search(r"\d (KiB|MiB|GiB)\b", line) for line in rows)
