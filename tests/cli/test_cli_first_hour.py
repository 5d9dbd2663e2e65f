"""Issue 27, "the first hour with a real model": the command line's rough edges (items 8-13)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_helpers import Root, assert_user_error, run, run_here

from kvstore import Store

# --- item 8: temp files an interrupted save left are counted, and removed at once ------------

_ABANDON = textwrap.dedent("""
    import os, sys
    from kvstore import Store
    with Store.open(sys.argv[1], create=False) as s:
        s.local.blocks.stage([b"x" * int(sys.argv[2])])  # a block written, never published
    os._exit(0)  # the writer is gone, as after Ctrl-C or a kill in the middle of a save
""")


def test_temp_files_of_a_writer_that_is_gone_are_counted_and_compacted(fresh_root: Root) -> None:
    root = fresh_root.path
    p = subprocess.run([sys.executable, "-P", "-c", _ABANDON, str(root), str(3 << 20)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    with Store.open(root, create=False) as s:
        live = s.local.blocks.stage([b"y" * 1000])  # this process's own: a save in progress
    st = run_here("stats", "--json", "--root", root).json()
    assert (st["tmp_files"], st["tmp_bytes"]) == (2, (3 << 20) + 1000)
    assert (st["tmp_abandoned_files"], st["tmp_abandoned_bytes"]) == (1, 3 << 20)
    text = run_here("stats", "--root", root).out
    row = next(line for line in text.splitlines() if line.startswith("temp files "))
    assert row.split(None, 2)[2] == ("1 file, 3.0 MiB left by writers that are gone (an "
                                     f"interrupted save): 'kvstore compact --root {root}' "
                                     "removes them; "
                                     "1 file, 1000 B being written")
    v = run_here("verify", "--root", root)
    assert v.code == 0 and ("note: tmp/ holds 1 file (3.0 MiB) left by writers that are gone "
                            f"(an interrupted save); 'kvstore compact --root {root}' removes "
                            "them") in v.out
    dry = run_here("compact", "--dry-run", "--json", "--root", root).json()["report"]
    assert (dry["tmp_removed"], dry["tmp_bytes"]) == (1, 3 << 20)
    done = run_here("compact", "--json", "--root", root).json()["report"]  # default grace
    assert (done["tmp_removed"], done["tmp_bytes"]) == (1, 3 << 20)
    # a live writer's file is never taken
    assert os.listdir(root / "tmp") == [os.path.basename(live.path)]
    st = run_here("stats", "--json", "--root", root).json()
    assert (st["tmp_files"], st["tmp_abandoned_files"]) == (1, 0)
    os.unlink(live.path)
    assert "temp files" not in run("stats", "--root", root).out


# --- item 9: compact says when held-back bytes are free; a budget without its unit -----------


def test_compact_says_when_the_bytes_it_holds_back_are_free(fresh_root: Root) -> None:
    root = fresh_root.path
    r = run_here("compact", "--max-bytes", "2K", "--root", root)
    assert r.code == 0, r
    lines = r.out.splitlines()
    (held,) = [line for line in lines if line.startswith("held back")]
    assert re.search(r"until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(in 1[01] min; a compact after "
                     r"that frees them; 'kvstore compact --grace 0 --root \S+' frees them "
                     r"now\)$", held)
    (then,) = [line for line in lines if line.startswith("on disk then")]
    assert then.endswith("0 B once they are freed, within --max-bytes 2.0 KiB"), then
    d = run_here("compact", "--grace", "0", "--json", "--root", root).json()["report"]
    assert d["physical_after"] == 0


@pytest.mark.parametrize("option", ["--max-bytes", "--namespace-max-bytes"])
def test_a_budget_without_its_unit_is_refused_before_anything_is_evicted(
    fresh_root: Root, option: str
) -> None:
    root = fresh_root.path
    before = run_here("ls", "--json", "--root", root).json()["entries"]
    r = run_here("compact", option, "20", "--root", root)
    assert_user_error(r, option, "20 has no unit: 20 bytes would evict nearly every entry; "
                      "did you mean 20M or 20G? (write 20B if you mean bytes)")
    assert run_here("ls", "--json", "--root", root).json()["entries"] == before
    assert run_here("compact", option, "20B", "--dry-run", "--root", root).code == 0
    assert run_here("compact", option, "0", "--dry-run", "--root", root).code == 0
    assert run_here("compact", option, "1048576", "--dry-run", "--root", root).code == 0


def test_serve_refuses_a_budget_without_its_unit_too(tmp_path: Path) -> None:
    r = run("serve", "--max-bytes", "20", "--root", tmp_path / "root")
    assert_user_error(r, "--max-bytes", "20 has no unit")
    assert not (tmp_path / "root").exists()


def test_remote_compact_refuses_a_budget_without_its_unit() -> None:
    assert_user_error(run_here("--remote", "s3://b/p", "remote", "compact", "--max-bytes", "20"),
                      "--max-bytes", "20 has no unit")


# --- item 10: export keeps an existing file, names a missing directory, sizes its v5 blocks ---


def test_export_refuses_to_overwrite_without_force(shared_root: Root, tmp_path: Path) -> None:
    a40 = shared_root.ids["a40"]
    out = tmp_path / "a40.kv"
    out.write_bytes(b"my own file\n")
    r = run_here("export", a40, out, "--root", shared_root.path)
    assert_user_error(r, f"{out} exists; give --force to overwrite it")
    assert out.read_bytes() == b"my own file\n"
    r = run_here("export", a40, out, "--force", "--root", shared_root.path)
    assert r.code == 0, r
    assert out.read_bytes()[:10] == b"MLXBUNKV2\n"


def test_export_into_a_missing_directory_names_it(shared_root: Root, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    for fmt in ("v3", "v5"):
        r = run_here("export", shared_root.ids["a40"], missing / "a.kv", "--format", fmt,
                     "--root", shared_root.path)
        assert_user_error(r, f"{missing}: no such directory")
        assert ".tmp" not in r.err
    assert not missing.exists()


def test_the_api_export_names_a_missing_directory_too(shared_root: Root, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with Store.open(shared_root.path, create=False) as s, pytest.raises(FileNotFoundError) as e:
        s.export(shared_root.ids["a40"], missing / "a.kv")
    assert e.value.filename == str(missing) and e.value.strerror == "no such directory"
    assert not missing.exists()


def test_a_v5_export_reports_the_blocks_it_wrote(shared_root: Root, tmp_path: Path) -> None:
    out = tmp_path / "v5" / "a90.kv"
    out.parent.mkdir()
    d = run_here("export", shared_root.ids["a90"], out, "--format", "v5", "--json",
                 "--root", shared_root.path).json()
    files = sorted((out.parent / "blocks").iterdir())
    assert d["file_bytes"] == out.stat().st_size
    assert d["block_files"] == len(files) > 0
    assert d["block_bytes"] == sum(f.stat().st_size for f in files)
    logical = {e["id"]: e["logical_bytes"] for e in
               run_here("ls", "--json", "--root", shared_root.path).json()["entries"]}
    assert 0 < d["block_bytes"] <= logical[d["id"]]  # pieces alike in two tensors: one file
    assert d["blocks_dir"] == str(out.parent / "blocks")
    human = run_here("export", shared_root.ids["a90"], tmp_path / "v5" / "b.kv", "--format",
                     "v5", "--root", shared_root.path).out
    assert re.fullmatch(rf"exported {shared_root.ids['a90'][:12]} to .*b\.kv \(v5, 90 tokens, a "
                        rf"[\d.]+ KiB header file \+ [\d.]+ KiB in {len(files)} block files under "
                        rf"{re.escape(str(out.parent / 'blocks'))}/\)\n", human), human


# --- item 13: verify and compact show progress; inspect and model fetch offer no --root -------


def test_verify_and_compact_report_their_progress(fresh_root: Root) -> None:
    with Store.open(fresh_root.path, create=False) as s:
        physical = s.stats().physical_bytes
        calls: list[tuple[str, int, int]] = []
        s.verify(read_data=True, progress=lambda *a: calls.append(a))
        assert calls[-1] == ("blocks", physical, physical)
        assert [c[1] for c in calls] == sorted(c[1] for c in calls) and len(calls) > 1
        for name in ("a90", "o48"):
            s.delete(fresh_root.ids[name])
        calls.clear()
        swept = s.compact(grace=0, progress=lambda *a: calls.append(a))
        assert swept.freed_blocks > 0 and not swept.evicted
        assert calls[-1] == ("sweep", swept.freed_blocks, swept.freed_blocks)
        assert not any(c[0] == "evict" for c in calls)
        calls.clear()
        report = s.compact(max_bytes=0, grace=0, progress=lambda *a: calls.append(a))
    assert len(report.evicted) == 4
    assert [c for c in calls if c[0] == "evict"][-1] == ("evict", 4, 4)


def _on_a_terminal(*args: str | Path) -> str:
    """``kvstore ARGS`` with stdout and stderr on a pseudo-terminal, as a person runs it."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # rows, cols
    p = subprocess.Popen([sys.executable, "-P", "-m", "kvstore", *map(str, args)],
                         stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the other side is closed
                break
            if not chunk:
                break
            out += chunk
        assert p.wait(60) in (0, 1)
    finally:
        os.close(master)
    return out.decode(errors="replace")


def test_verify_read_data_and_compact_show_a_bar_on_a_terminal(fresh_root: Root) -> None:
    out = _on_a_terminal("verify", "--read-data", "--root", fresh_root.path)
    assert "blocks:" in out and "ok: the store is sound" in out, out
    out = _on_a_terminal("compact", "--max-bytes", "0", "--grace", "0", "--root",
                         fresh_root.path)
    assert "evict:" in out and "sweep:" in out, out
    assert "-q" not in out
    quiet = _on_a_terminal("verify", "--read-data", "-q", "--root", fresh_root.path)
    assert "blocks:" not in quiet
