"""Issue 27, "the first hour with a real model": the command line's rough edges (items 8-13)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from cli_helpers import Root, run, run_here

from kvstore import Store

# --- item 8: temp files an interrupted save left are counted, and removed at once ------------

_ABANDON = textwrap.dedent("""
    import os, sys
    from kvstore import Store
    with Store.open(sys.argv[1], create=False) as s:
        s.blocks.write_tmp([b"x" * int(sys.argv[2])])  # a block written, never published
    os._exit(0)  # the writer is gone, as after Ctrl-C or a kill in the middle of a save
""")


def test_temp_files_of_a_writer_that_is_gone_are_counted_and_compacted(fresh_root: Root) -> None:
    root = fresh_root.path
    p = subprocess.run([sys.executable, "-P", "-c", _ABANDON, str(root), str(3 << 20)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    with Store.open(root, create=False) as s:
        live = s.blocks.write_tmp([b"y" * 1000])  # this process's own: a save in progress
    st = run_here("stats", "--json", "--root", root).json()
    assert (st["tmp_files"], st["tmp_bytes"]) == (2, (3 << 20) + 1000)
    assert (st["tmp_abandoned_files"], st["tmp_abandoned_bytes"]) == (1, 3 << 20)
    text = run_here("stats", "--root", root).out
    assert ("temp files    1 file, 3.0 MiB left by writers that are gone (an interrupted "
            "save): 'kvstore compact' removes them; 1 file, 1000 B being written") in text
    v = run_here("verify", "--root", root)
    assert v.code == 0 and ("note: tmp/ holds 1 file (3.0 MiB) left by writers that are gone "
                            "(an interrupted save); 'kvstore compact' removes them") in v.out
    dry = run_here("compact", "--dry-run", "--json", "--root", root).json()["report"]
    assert (dry["tmp_removed"], dry["tmp_bytes"]) == (1, 3 << 20)
    done = run_here("compact", "--json", "--root", root).json()["report"]  # default grace
    assert (done["tmp_removed"], done["tmp_bytes"]) == (1, 3 << 20)
    assert os.listdir(root / "tmp") == [live.name]  # a live writer's file is never taken
    st = run_here("stats", "--json", "--root", root).json()
    assert (st["tmp_files"], st["tmp_abandoned_files"]) == (1, 0)
    live.unlink()
    assert "temp files" not in run("stats", "--root", root).out
