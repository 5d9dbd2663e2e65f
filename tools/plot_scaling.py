"""Plot tools/scaling.py's figures: one PNG per curve, in docs/.

    python tools/plot_scaling.py FILE [--out docs]

Each plot is log-log with a dashed line of slope 1 through the curve's
cheapest point per unit of work: where the curve leaves that line the cost
stops being linear (above it: each unit costs more; below it: a fixed cost is
still being spread out). The same is printed as the cost per unit at every
point, relative to that cheapest one. Needs matplotlib (``pip install
matplotlib``; it is no dependency of kvstore).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _linear(ax: Any, xs: Sequence[float], ys: Sequence[float], color: str) -> None:
    per = min(y / x for x, y in zip(xs, ys, strict=True))
    label = "dashed: linear through each curve's cheapest point"
    once = label if label not in [ln.get_label() for ln in ax.get_lines()] else "_nolegend_"
    ax.plot([xs[0], xs[-1]], [per * xs[0], per * xs[-1]], ls="--", lw=0.8, color=color, alpha=0.6,
            label=once)


def _series(ax: Any, xs: Sequence[float], ys: Sequence[float], label: str, color: str,
            unit: str) -> None:
    ax.plot(xs, ys, "o-", color=color, label=label)
    _linear(ax, xs, ys, color)
    per = [y / x for x, y in zip(xs, ys, strict=True)]
    best = min(per)
    rel = ", ".join(f"{int(x)}: {p / best:.2f}" for x, p in zip(xs, per, strict=True))
    print(f"  {label}: cost per {unit} relative to the cheapest point: {rel}")


def _finish(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8)


COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def plot(doc: dict[str, Any], out: Path) -> list[Path]:
    made: list[Path] = []
    cpus = doc.get("machine", {}).get("cpus", "?")
    sr = doc.get("save_restore")
    if sr:
        pts = sr["points"]
        xs = [p["tokens"] for p in pts]
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        print("save/restore vs tokens")
        for key, c in zip(("save durable", "save non-durable", "restore page cache",
                           "restore after eviction"), COLORS, strict=False):
            _series(ax, xs, [p[key] for p in pts], key, c, "token")
        _finish(ax, "tokens (16 layers x 8 KV heads x 128, bfloat16: 64 KiB a token)",
                "seconds", f"save and restore time vs tokens ({cpus} CPUs)")
        made.append(_save(fig, out / "scaling-save-restore.png"))
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        print("verify vs bytes")
        _series(ax, [p["bytes"] / 2**20 for p in pts], [p["verify read_data"] for p in pts],
                "verify(read_data=True), page cache", COLORS[0], "MiB")
        _finish(ax, "MiB of blocks", "seconds", f"verify time vs bytes ({cpus} CPUs)")
        made.append(_save(fig, out / "scaling-verify.png"))
    lk = doc.get("lookup")
    if lk:
        pts = lk["points"]
        xs = [p["entries"] for p in pts]
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        print("lookup vs entries")
        for key, c in zip(("p50", "p99"), COLORS, strict=False):
            ys = [p[key] * 1e6 for p in pts]
            ax.plot(xs, ys, "o-", color=c, label=f"lookup {key}")
            rel = ", ".join(f"{int(x)}: {y / ys[0]:.2f}" for x, y in zip(xs, ys, strict=True))
            print(f"  {key} relative to {int(xs[0])} entries: {rel}")
        if all("raw_gets_p50" in p for p in pts):  # the index reads alone, replayed as gets
            ys = [p["raw_gets_p50"] * 1e6 for p in pts]
            gets = "-".join(sorted({f"{p['gets']:.0f}" for p in pts}, key=float))
            ax.plot(xs, ys, "s--", color=COLORS[2], label=f"its {gets} LMDB gets alone (p50)")
            rel = ", ".join(f"{int(x)}: {y / ys[0]:.2f}" for x, y in zip(xs, ys, strict=True))
            print(f"  gets alone relative to {int(xs[0])} entries: {rel}")
        ax.set_ylim(bottom=0)
        ax.set_xscale("log")
        ax.set_xlabel("entries")
        ax.set_ylabel("µs")
        ax.set_title(f"lookup of a {lk['query_tokens']}-token query vs entries ({cpus} CPUs)",
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=8)
        made.append(_save(fig, out / "scaling-lookup.png"))
    cp = doc.get("compact")
    if cp:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
        print("compact")
        bb = cp["by_blocks"]
        if bb:
            _series(a1, [p["blocks"] for p in bb], [p["compact"] for p in bb],
                    "compact(grace=0), 16 blocks an entry", COLORS[0], "block")
            _finish(a1, "blocks", "seconds", "compact vs blocks")
        be = cp["by_entries"]
        if be:
            _series(a2, [p["entries"] for p in be], [p["compact"] for p in be],
                    "compact(grace=0), 100k blocks", COLORS[1], "entry")
            _finish(a2, "entries", "seconds", "compact vs entries at 100k blocks")
        fig.suptitle(f"compact time, a tenth of the entries deleted first ({cpus} CPUs)",
                     fontsize=10)
        made.append(_save(fig, out / "scaling-compact.png"))
    return made


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs"))
    args = ap.parse_args()
    doc = json.loads(Path(args.file).read_text(encoding="utf-8"))
    for p in plot(doc, Path(args.out)):
        print(f"wrote {p.name}")


if __name__ == "__main__":
    main()
