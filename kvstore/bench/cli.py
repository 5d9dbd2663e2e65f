"""``kvstore bench``: run every case, print the side-by-side table, write the JSON."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .common import CONFIGS, QUICK, Config, Row, cache_bytes, machine, make_cache
from .report import human, table, targets, targets_table

GROUPS = ("save", "restore", "multiturn", "shared", "lookup", "ttft", "checkpoints",
          "concurrency", "startup", "remote", "gpu")
MODEL_GROUP = "model"  # only with --model: a real model's prefill takes minutes on a CPU
AGENTS_GROUP = "agents"  # only with --only agents: a replayed agent session, minutes on a CPU
SERVE_GROUP = "serve"  # only with --only serve: kvstore serve vs mlx_lm.server, ~10 min on a CPU


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore bench", description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="smaller: 4k tokens only, fewer reps, lookup up to 10k entries")
    p.add_argument("--json", metavar="FILE", help="write the rows and targets as JSON")
    p.add_argument("--config", choices=sorted(CONFIGS), help="a named size (overrides --quick)")
    p.add_argument("--only", metavar="GROUPS",
                   help=f"comma-separated subset of {','.join(GROUPS)}; also {AGENTS_GROUP} "
                        f"(a replayed agent session) and {SERVE_GROUP} (kvstore serve against "
                        "mlx_lm.server: concurrent sessions, TTFT under a long prefill, "
                        "subagents; with --model, on it instead of SmolLM2), not run by default")
    p.add_argument("--remote", metavar="URL",
                   help="s3://BUCKET/PREFIX for the remote group (default: $KVSTORE_REMOTE; "
                        "without one, or when it does not answer, the group is skipped)")
    p.add_argument("--scratch", metavar="DIR",
                   help="where the temporary roots go (default: the system temp dir)")
    p.add_argument("--model", metavar="smollm2|DIR",
                   help="a real model ('smollm2', fetched on first use, or an mlx-lm model "
                        "directory): adds the model group (pick it alone with --only model)")
    return p


def run(cfg: Config, scratch: Path, groups: tuple[str, ...],
        log: Callable[[str], None] = print, remote: str | None = None,
        model_dir: Path | None = None) -> list[Row]:
    """Run the chosen cases of ``cfg`` under ``scratch``; returns their rows. The remote
    group needs ``remote`` (an s3:// URL), the model group ``model_dir``."""
    from .index_cases import lookup_rows, ttft_rows
    from .io_cases import (
        SavedPair,
        multiturn_rows,
        restore_rows,
        save_rows,
        shared_rows,
    )

    rows: list[Row] = []

    def add(new: list[Row]) -> None:
        rows.extend(new)
        for r in new:
            log(f"  {r.name}: kvstore {human(r.kvstore, r.unit)}, "
                f"baseline {human(r.baseline, r.unit)}, ratio {r.ratio:.3f}")

    if {"save", "restore", "concurrency"} & set(groups):
        for n in cfg.sizes:
            log(f"[save/restore] {n} tokens, {cfg.layers} layers")
            cache = make_cache(cfg, n, seed=n)
            if "save" in groups:
                add(save_rows(cfg, scratch, n, cache))
            if {"restore", "concurrency"} & set(groups):
                pair = SavedPair(scratch, n, cache)
                try:
                    if "restore" in groups:
                        add(restore_rows(cfg, pair))  # and its limit rows, from the same runs
                    if "concurrency" in groups and n == cfg.sizes[0]:
                        _concurrency(cfg, scratch, add, log)
                finally:
                    pair.remove()
            del cache
    if "multiturn" in groups:
        log(f"[multi-turn] {cfg.turns} turns x {cfg.turn_tokens} tokens")
        add(multiturn_rows(cfg, scratch))
    if "shared" in groups:
        log(f"[shared prompt] {cfg.sessions} sessions")
        add(shared_rows(cfg, scratch))
    if "lookup" in groups:
        log(f"[lookup] {', '.join(str(n) for n in cfg.lookup_entries)} entries")
        add(lookup_rows(cfg, scratch))
    if "ttft" in groups:
        log("[ttft] tiny llama")
        add(ttft_rows(cfg, scratch))
    if "checkpoints" in groups:
        from .checkpoint_cases import checkpoint_rows

        add(checkpoint_rows(cfg, scratch, log))
    if "startup" in groups:
        from .startup_cases import startup_rows

        log(f"[startup] a fresh process on a small root (load average {_load()})")
        add(startup_rows(cfg, scratch))
    if "remote" in groups:
        from .remote_cases import reachable, remote_rows

        if not remote:
            log("[remote] skipped: no --remote URL and no $KVSTORE_REMOTE")
        elif why := reachable(remote):
            log(f"[remote] skipped: {why}")
        else:
            log(f"[remote] {remote}")
            add(remote_rows(cfg, scratch, remote))
    if AGENTS_GROUP in groups:
        from .agent_cases import agent_rows

        add(agent_rows(scratch, log))
    if SERVE_GROUP in groups:
        from .serve_cases import serve_rows

        add(serve_rows(scratch, log, quick=cfg.name != "full", model=model_dir))

    if "gpu" in groups:
        from .gpu_cases import gpu_rows

        add(gpu_rows(cfg, scratch, log))  # one line and no rows where MLX has no GPU
    if MODEL_GROUP in groups and model_dir is not None:
        from .model_cases import model_rows

        add(model_rows(cfg, scratch, model_dir, log))
    return rows


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _concurrency(cfg: Config, scratch: Path, add: Callable[[list[Row]], None],
                 log: Callable[[str], None]) -> None:
    from .concurrency import concurrency_rows
    from .io_cases import SavedPair

    n = cfg.conc_tokens
    log(f"[concurrency] {n} tokens, processes {cfg.procs}")
    cache = make_cache(cfg, n, seed=n + 1)
    pair = SavedPair(scratch, n, cache)
    nbytes = cache_bytes(cache)
    del cache
    try:
        pair.warm()
        add(concurrency_rows(cfg, pair.root, pair.file, pair.tokens, nbytes))
    finally:
        pair.remove()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvstore bench``; returns the exit status."""
    args = _parser().parse_args(argv)
    cfg = CONFIGS[args.config] if args.config else (QUICK if args.quick else CONFIGS["full"])
    groups = GROUPS + ((MODEL_GROUP,) if args.model else ())
    if args.only:
        groups = tuple(g.strip() for g in args.only.split(",") if g.strip())
        bad = [g for g in groups if g not in (*GROUPS, MODEL_GROUP, AGENTS_GROUP, SERVE_GROUP)]
        if bad:
            print(f"kvstore bench: unknown group(s) {', '.join(bad)}; choose from "
                  f"{', '.join(GROUPS)}, {AGENTS_GROUP}, {SERVE_GROUP}, {MODEL_GROUP} "
                  "(with --model)",
                  file=sys.stderr)
            return 2
    model_dir = None
    if SERVE_GROUP in groups and args.model and MODEL_GROUP not in groups:
        from .model_cases import resolve_model

        try:
            model_dir = resolve_model(args.model)
        except ValueError as e:
            print(f"kvstore bench: {e}", file=sys.stderr)
            return 2
    if MODEL_GROUP in groups:
        from .model_cases import resolve_model

        if not args.model:
            print("kvstore bench: the model group needs --model smollm2|DIR", file=sys.stderr)
            return 2
        try:
            model_dir = resolve_model(args.model)
        except ValueError as e:
            print(f"kvstore bench: {e}", file=sys.stderr)
            return 2
    base = Path(args.scratch) if args.scratch else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=base))
    free = shutil.disk_usage(scratch).free
    info = machine(scratch)
    print(f"kvstore bench ({cfg.name}): {info['nproc']} CPUs, {info['memory_gib']} GiB, "
          f"{info['cpu']}, {info['filesystem']}; {free / 2**30:.0f} GiB free for scratch")
    t0 = time.perf_counter()
    try:
        rows = run(cfg, scratch, groups, remote=args.remote or os.environ.get("KVSTORE_REMOTE"),
                   model_dir=model_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    ts = targets(rows)
    print()
    print(table(rows))
    print()
    print(targets_table(ts))
    print(f"\n{len(rows)} rows in {elapsed:.0f} s" + (f"; {cfg.note}" if cfg.note else ""))
    if args.json:
        doc: dict[str, Any] = {
            "schema": "kvstore-bench/1",
            "config": asdict(cfg),
            "machine": info,
            "elapsed_s": elapsed,
            "rows": [r.as_dict() for r in rows],
            "targets": [asdict(t) for t in ts],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0
