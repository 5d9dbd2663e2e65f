"""Time and peak memory of ``kvstore ls``, ``tree``, ``stats`` and ``compact`` on a root of
N entries (issue 29, item 7): the figures in docs/BENCHMARKS.md, "Roots of 100k entries".

    python tools/scale_cli.py --entries 100000 [--root DIR] [--kvstore CMD] [--json FILE]

The root is built by ``tools/fast_root.py`` (``LookupIndexBuilder``: entries of one of 64
system prompts plus 16-128 tokens of their own, 256-token blocks; the index exactly as
saves would leave it, the block files not written) and kept in ``--root`` for the next
run (built again only when it holds another number of entries). Each command runs in a
subprocess of its own, its output to /dev/null; its wall time, its peak RSS
(``os.wait4``'s rusage of that one child: ``RUSAGE_CHILDREN`` would give the largest child
so far) and its peak anonymous RSS (``RssAnon``, sampled every 10 ms: the peak RSS also
counts the index pages the command touched, mapped from the page cache) are printed.
``compact`` runs on a fresh copy of the root, with a byte budget of
half its bytes and ``--grace 0`` (it evicts half the entries and deletes their blocks'
records), and ``compact --dry-run`` plans the same on the root itself.

``--kvstore`` is the command line to measure (default: this interpreter's ``-m kvstore``),
so that two versions of kvstore run against the same root, e.g. a checkout of main's
``.venv/bin/kvstore``; the commands run with the root's parent as working directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

NS_ARGS = dict(model_id="kvstore-scale-cli", config_fingerprint="synthetic")
COMMANDS: dict[str, list[str]] = {
    "ls": ["ls"],
    "ls --json": ["ls", "--json"],
    "tree": ["tree"],
    "stats": ["stats"],
    "compact --dry-run": ["compact", "--dry-run", "--grace", "0", "--max-bytes", "{half}"],
    "compact": ["compact", "--grace", "0", "--max-bytes", "{half}"],
}


def build(root: Path, n: int) -> dict[str, Any]:
    """The root of ``n`` entries (reused when its marker says it has them), built in a
    subprocess: this process stays small (a child's peak RSS counts its parent's at fork)."""
    marker = root / "scale-cli.json"
    if not marker.exists() or json.loads(marker.read_text()).get("entries") != n:
        subprocess.run([sys.executable, __file__, "--build-only", "--entries", str(n),
                        "--root", str(root.parent)], check=True)
    info: dict[str, Any] = json.loads(marker.read_text())
    return info


def _build(root: Path, n: int) -> None:
    marker = root / "scale-cli.json"
    from fast_root import LookupIndexBuilder

    from kvstore import Namespace, Store

    if root.exists():
        shutil.rmtree(root)
    t0 = time.perf_counter()
    b = LookupIndexBuilder(root, Namespace(**NS_ARGS))
    b.grow_to(n)
    b.close()
    with Store.open(root, create=False) as s:
        st = s.stats()
    info = {"entries": n, "build_s": round(time.perf_counter() - t0, 1),
            "logical_bytes": st.logical_bytes, "physical_bytes": st.physical_bytes}
    marker.write_text(json.dumps(info))


def _anon_kib(pid: int) -> int:
    """The process's anonymous resident memory (its heap, not the index pages it maps)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run(argv: list[str], cwd: Path) -> tuple[float, float, float, int]:
    """(wall seconds, peak RSS MiB, peak anonymous RSS MiB, exit status) of one command.

    The peak RSS counts the pages of the LMDB index the command touched (mapped from the
    page cache: shared, and dropped under memory pressure); the anonymous peak, sampled
    every 10 ms, is the process's own memory.
    """
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    anon = 0
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        anon = max(anon, _anon_kib(p.pid))
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode(errors="replace") if p.stderr else ""
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        print(f"  {shlex.join(argv)}: exit {p.returncode}\n{err[-2000:]}", file=sys.stderr)
    return wall, usage.ru_maxrss / 1024, anon / 1024, p.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--root", type=Path, default=Path("/tmp/kvstore-scale-cli"))
    ap.add_argument("--kvstore", default=f"{shlex.quote(sys.executable)} -m kvstore",
                    help="the command line of the kvstore to measure")
    ap.add_argument("--only", nargs="*", default=list(COMMANDS), choices=list(COMMANDS))
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    root = a.root.resolve() / f"root-{a.entries}"
    if a.build_only:
        _build(root, a.entries)
        return
    info = build(root, a.entries)
    print(f"root: {a.entries} entries ({info['physical_bytes']} bytes of blocks, built in "
          f"{info['build_s']} s); kvstore: {a.kvstore}")
    base = shlex.split(a.kvstore)
    half = str(max(1, info["physical_bytes"] // 2))
    rows: dict[str, dict[str, float]] = {}
    for name in a.only:
        args = [x.replace("{half}", half) for x in COMMANDS[name]]
        target = root
        if name == "compact":  # it changes the root: a copy of it
            target = root.parent / f"{root.name}-compact"
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(root, target)
        try:
            wall, rss, anon, rc = run([*base, "--quiet", "--root", str(target), *args],
                                      root.parent)
        finally:
            if target != root:
                shutil.rmtree(target, ignore_errors=True)
        rows[name] = {"seconds": round(wall, 2), "peak_rss_mib": round(rss, 1),
                      "peak_anon_mib": round(anon, 1), "exit": rc}
        print(f"  {name:18s} {wall:8.2f} s  peak RSS {rss:7.1f} MiB  anonymous {anon:7.1f} MiB"
              + (f"  exit {rc}" if rc else ""), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps({"root": info, "kvstore": a.kvstore, "rows": rows},
                                     indent=1))


if __name__ == "__main__":
    main()
