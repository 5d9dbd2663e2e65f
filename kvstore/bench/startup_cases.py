"""The ``startup`` group: how long a fresh process takes to open a root and run a command.

Every command of the command line runs in a process of its own, so what it costs
before it does anything is paid on every call. Each figure is a fresh
``python -P`` process on a small root (24 entries of a few KiB), the median of
``cfg.reps`` runs after one warm-up (which writes the bytecode caches, as an install
does: see :func:`_env`), interleaved with its baseline: the same
process with mlx-lm's cache module imported first, which is what every command
paid before issue 27 made that import lazy (mlx-lm loads transformers). The
targets (issue 27) are absolute: ``import kvstore`` + ``Store.open`` under 0.1 s
(timed inside the process), each command under 0.3 s (the whole process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from ..schema import Namespace
from ..store import Store
from .common import Config, KVCache, Row, interleave, median

__all__ = ["OPEN_TARGET", "COMMAND_TARGET", "startup_rows"]

OPEN_TARGET = 0.1  # seconds: import kvstore + Store.open
COMMAND_TARGET = 0.3  # seconds: a whole `kvstore stats` (etc.) process on a small root
ENTRIES = 24
_BEFORE = "import mlx_lm.models.cache\n"  # the baseline: what every command imported before

_OPEN = """
import sys, time
t = time.perf_counter()
{before}import kvstore
from kvstore import Store
Store.open(sys.argv[1]).close()
print(time.perf_counter() - t)
"""

_COMMAND = """
import sys
{before}from kvstore.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _small_root(path: Path, n: int) -> list[str]:
    """A root of ``n`` short entries; their ids."""
    with Store.open(path, namespace=Namespace(model_id="startup"), block_tokens=16) as store:
        for i in range(n):
            c = KVCache()
            kv = mx.full((1, 2, 48, 16), float(i), dtype=mx.float16)
            c.update_and_fetch(kv, kv)
            store.save(list(range(i, i + 48)), [c])
        return [e.id for e in store.entries()]


def _env() -> dict[str, str]:
    """The children's environment: no root of the caller's, and bytecode cached as an
    installed package has it (pip compiles it; an editable install writes it on the first
    import, the warm-up here). ``PYTHONDONTWRITEBYTECODE`` left in would make every run
    compile each module of kvstore from source, some 70 ms no user pays."""
    env = dict(os.environ)
    env.pop("KVSTORE_ROOT", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _opened(root: Path, before: str) -> float:
    """Seconds inside a fresh process from ``import kvstore`` to an open (and closed) root."""
    p = subprocess.run([sys.executable, "-P", "-c", _OPEN.format(before=before), str(root)],
                       capture_output=True, text=True, env=_env(), timeout=120, check=True)
    return float(p.stdout.strip().splitlines()[-1])


def _command(args: list[str], before: str) -> float:
    """Wall seconds of a whole fresh process running ``kvstore ARGS``."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-P", "-c", _COMMAND.format(before=before), *args],
                   capture_output=True, env=_env(), timeout=120, check=True)
    return time.perf_counter() - t


def startup_rows(cfg: Config, scratch: Path) -> list[Row]:
    """import + open, then each of ``cfg.startup_commands``, against the same with mlx-lm
    imported first."""
    root = Path(tempfile.mkdtemp(prefix="startup-", dir=scratch))
    n = max(ENTRIES, 2 * (cfg.reps + 1) + 1)  # rm takes one a run: the warm-ups, both sides
    ids = _small_root(root, n)
    victims = iter(ids[1:])
    base = ["--root", str(root), "-q"]
    label = ("the same with mlx_lm.models.cache imported first (what every command "
             "paid when the codecs imported mlx-lm)")
    rows: list[Row] = []
    res = interleave({"kv": lambda: _opened(root, ""), "old": lambda: _opened(root, _BEFORE)},
                     cfg.reps)
    rows.append(Row("startup", "startup: import kvstore + Store.open (inside the process)", "s",
                    median(res["kv"]), median(res["old"]), label, "speedup",
                    extra={"target_s": OPEN_TARGET, "entries": n}))
    file = root.parent / f"{root.name}.v3"  # an mlx-bun file of one entry: inspect, import
    if {"inspect", "import"} & set(cfg.startup_commands):
        with Store.open(root) as store:
            store.export(ids[0], file)
    for cmd in cfg.startup_commands:
        args = {"show": [cmd, ids[0]], "rm": [cmd], "inspect": [cmd, str(file)],
                "import": [cmd, str(file)],  # already there: it reads, checks and finds it
                "export": [cmd, ids[0], str(root.parent / f"{root.name}-out.v3"), "--force"],
                }.get(cmd, [cmd])

        def run(before: str, args: list[str] = args) -> float:
            extra = [next(victims)] if args == ["rm"] else []
            return _command([*base, *args, *extra], before)

        res = interleave({"kv": lambda: run(""), "old": lambda: run(_BEFORE)}, cfg.reps)
        rows.append(Row("startup", f"startup: kvstore {cmd} (the whole process)", "s",
                        median(res["kv"]), median(res["old"]), label, "speedup",
                        extra={"target_s": COMMAND_TARGET, "entries": n}))
    return rows
