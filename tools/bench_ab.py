"""``kvstore bench`` on two checkouts, interleaved: did a change make anything slower?

Runs ``python -P -m kvstore bench --config CONFIG --json F`` with each checkout first on
``PYTHONPATH`` (its C extension built in place: ``python setup.py build_ext --inplace``),
alternating the sides and their order round by round so that a machine growing busier
or quieter meets both alike, then prints, per row of the report, the median of each
side's kvstore figure and new/old (below 1: the new checkout is faster for a time).

    python tools/bench_ab.py --old ../kvstore-old --new . --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(side: Path, config: str, only: str | None, out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(side.resolve())}
    cmd = [sys.executable, "-P", "-m", "kvstore", "bench", "--config", config,
           "--json", str(out)]
    if only:
        cmd += ["--only", only]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    return {f"{r['group']}: {r['name']}": float(r["kvstore"]) for r in rows
            if isinstance(r.get("kvstore"), (int, float)) and r.get("unit") in ("s", "ms")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", default="quick", choices=("quick", "smoke", "full"))
    ap.add_argument("--only", help="as kvstore bench --only")
    args = ap.parse_args()
    got: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            for side in order:
                res = run(getattr(args, side), args.config, args.only,
                          Path(tmp) / f"{side}{i}.json")
                for name, v in res.items():
                    got[side].setdefault(name, []).append(v)
                print(f"round {i + 1}/{args.rounds}: {side} done", file=sys.stderr)
    print(f"| row ({args.rounds} interleaved rounds, medians) | old | new | new/old |")
    print("|---|---|---|---|")
    ratios = []
    for name, olds in got["old"].items():
        news = got["new"].get(name)
        if not news:
            continue
        o, n = statistics.median(olds), statistics.median(news)
        r = n / o if o > 0 else float("nan")
        ratios.append(r)
        print(f"| {name} | {o:.4g} | {n:.4g} | {r:.2f} |")
    if ratios:
        print(f"\nrows: {len(ratios)}; new/old median {statistics.median(ratios):.2f}, "
              f"min {min(ratios):.2f}, max {max(ratios):.2f}")


if __name__ == "__main__":
    main()
