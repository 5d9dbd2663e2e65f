"""What every benchmark case shares: configurations, rows, timing, caches, disk helpers."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

from .._vio import full_fsync

RatioKind = Literal["speedup", "fraction", "throughput"]

# mlx-lm's cache module is untyped: typed handles for what the cases use
KVCache: Any = _mlx_cache.KVCache



@dataclass(frozen=True)
class Config:
    """The sizes of one benchmark run (``full``, ``quick`` or the seconds-long ``smoke``)."""

    name: str
    layers: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    sizes: tuple[int, ...] = (4096, 16384)  # tokens of the save / restore caches
    reps: int = 5  # timed repetitions of each side (after one warm-up of each)
    turns: int = 16
    turn_tokens: int = 2000  # not a multiple of block_tokens: the honest case
    sessions: int = 100
    system_tokens: int = 4096
    session_tokens: int = 512
    lookup_entries: tuple[int, ...] = (1000, 10_000, 100_000)
    lookup_query: int = 32768
    lookup_reps: int = 300
    scan_reps: int = 15  # the linear-scan baseline is slow at 100k entries
    ttft_sizes: tuple[int, ...] = (1024, 4096)
    ttft_reps: int = 5
    model_hidden: int = 64  # make_tiny_model's defaults
    model_layers: int = 2
    procs: tuple[int, ...] = (1, 2)
    conc_tokens: int = 4096
    conc_reps: int = 6  # restores per process
    model_tokens: int = 4096  # the real model's TTFT prompt (the model group, with --model)
    # checkpoints during prefill (issue 26): tiny models of these kinds, a shared document
    ckpt_kinds: tuple[str, ...] = ("llama", "lfm2", "qwen3_5", "nemotron_h", "falcon_h1",
                                   "gemma3_text")
    ckpt_doc: int = 3300  # tokens of the document (after a 384-token system prompt)
    ckpt_every: int = 1024
    ckpt_reps: int = 5
    ckpt_layers: int = 4
    ckpt_window: int = 256  # gemma3_text's sliding window
    model_reps: int = 3  # restores timed per side; the prefill is timed once (minutes on a CPU)
    # the commands the startup group times in a fresh process (each also as `rm`, `show` ...)
    startup_commands: tuple[str, ...] = ("stats", "ls", "show", "tree", "rm", "verify", "compact",
                                         "inspect", "export", "import")
    # time to first token on a GPU (issue 37; the gpu group, where MLX has one)
    gpu_sizes: tuple[int, ...] = (4096, 16384, 32768)
    gpu_reps: int = 3
    note: str = ""


FULL = Config(name="full")
QUICK = Config(
    name="quick",
    sizes=(4096,),
    reps=3,
    turns=8,
    turn_tokens=1000,
    sessions=20,
    lookup_entries=(1000, 10_000),
    lookup_reps=200,
    scan_reps=10,
    ttft_reps=3,
    conc_reps=4,
    ckpt_reps=3,
    gpu_sizes=(4096,),
    note="quick: 4k tokens only, fewer reps; lookup stops at 10k entries",
)
SMOKE = Config(
    name="smoke",
    layers=2,
    kv_heads=2,
    head_dim=16,
    sizes=(600,),
    reps=1,
    turns=3,
    turn_tokens=300,
    sessions=3,
    system_tokens=512,
    session_tokens=64,
    lookup_entries=(10, 30),
    lookup_query=2048,
    lookup_reps=10,
    scan_reps=2,
    ttft_sizes=(300,),
    ttft_reps=1,
    conc_tokens=600,
    conc_reps=1,
    model_tokens=256,
    model_reps=1,
    ckpt_kinds=("llama", "lfm2", "gemma3_text"),
    ckpt_doc=300,
    ckpt_every=128,
    ckpt_reps=1,
    ckpt_layers=2,
    ckpt_window=64,
    startup_commands=("stats",),
    gpu_sizes=(300,),
    gpu_reps=1,
    note="smoke: checks that every case runs; its figures mean nothing",
)
CONFIGS = {c.name: c for c in (FULL, QUICK, SMOKE)}


@dataclass
class Row:
    """One side-by-side figure: kvstore, the baseline, and their ratio.

    ``ratio`` is ``baseline / kvstore`` for times (``speedup``: above 1 means
    kvstore is faster), ``kvstore / baseline`` for bytes (``fraction``: below 1
    means kvstore stores less) and for throughputs (``throughput``).
    """

    group: str
    name: str
    unit: str
    kvstore: float
    baseline: float
    baseline_label: str
    ratio_kind: RatioKind
    ratio: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    part_of: str = ""  # the row whose runs this one's figure is a part of (the limit rows)

    def __post_init__(self) -> None:
        if self.ratio_kind == "speedup":
            self.ratio = self.baseline / self.kvstore if self.kvstore else float("inf")
        else:
            self.ratio = self.kvstore / self.baseline if self.baseline else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- timing -----------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleave(
    sides: dict[str, Callable[[], float]], reps: int, *, before: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Run each side once to warm up, then ``reps`` rounds A B A B …; each side returns seconds.

    Alternating sides spreads the machine's noise (and memory the host took
    back) over both instead of charging it to whichever ran second.
    """
    out: dict[str, list[float]] = {k: [] for k in sides}
    for rnd in range(reps + 1):
        order = list(sides.items())
        if rnd % 2:
            order.reverse()
        for name, fn in order:
            if before is not None:
                before()
            t = fn()
            if rnd:
                out[name].append(t)
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by the nearest-rank method."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q * len(s) + 0.5)) - 1))
    return s[k]


def settle() -> None:
    """Write back dirty pages and collect garbage so one side's leftovers don't slow the next."""
    gc.collect()
    os.sync()


# --- caches --------------------------------------------------------------------------


def random_kv(cfg: Config, n: int, *, seed: int) -> tuple[mx.array, mx.array]:
    """Keys and values ``[1, H, n, D]`` in bfloat16, deterministic in ``seed``."""
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    shape = (1, cfg.kv_heads, n, cfg.head_dim)
    k = mx.random.normal(shape, key=k1).astype(mx.bfloat16)
    v = mx.random.normal(shape, key=k2).astype(mx.bfloat16)
    return k, v


def grow(cache: list[Any], cfg: Config, n: int, *, seed: int, chunk: int = 2048) -> None:
    """Append ``n`` tokens to every layer the way a prefill does (chunks of 2048)."""
    done = 0
    while done < n:
        m = min(chunk, n - done)
        for li, c in enumerate(cache):
            k, v = random_kv(cfg, m, seed=seed * 1_000_003 + li * 7919 + done)
            c.update_and_fetch(k, v)
        mx.eval([c.keys for c in cache] + [c.values for c in cache])
        done += m


def make_cache(cfg: Config, n: int, *, seed: int = 0) -> list[Any]:
    """A ``cfg.layers``-layer KVCache list holding ``n`` random tokens."""
    cache = [KVCache() for _ in range(cfg.layers)]
    grow(cache, cfg, n, seed=seed)
    return cache


def cache_bytes(cache: Sequence[Any]) -> int:
    """Bytes of the live keys and values (what a save must write)."""
    total = 0
    for c in cache:
        assert c.keys is not None and c.values is not None
        per_row = c.keys.nbytes // c.keys.shape[2] + c.values.nbytes // c.values.shape[2]
        total += per_row * c.offset
    return total


def decode_step(cache: Sequence[Any]) -> None:
    """One decode step on every layer: append one token's keys/values and evaluate.

    A cache allocated without spare capacity pays for a full copy here, as it
    would on its first real decode step.
    """
    arrays = []
    for c in cache:
        k = c.keys
        one = mx.zeros((k.shape[0], k.shape[1], 1, k.shape[3]), dtype=k.dtype)
        ck, cv = c.update_and_fetch(one, one)
        arrays += [ck, cv]
    mx.eval(arrays)


# --- disk ----------------------------------------------------------------------------------


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file or directory as the store flushes its own (:func:`full_fsync`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def drop_from_page_cache(paths: Sequence[Path]) -> None:
    """``POSIX_FADV_DONTNEED`` on every file (their data must be clean, i.e. synced)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, fs in os.walk(root) for f in fs]


def block_files(root: Path) -> list[Path]:
    return files_under(root / "blocks")


def disk_usage(root: Path) -> int:
    """Bytes allocated on disk for every file under ``root`` (sparse files count what they use)."""
    return sum(os.stat(p).st_blocks * 512 for p in files_under(root))


def read_all(paths: Sequence[Path]) -> None:
    """Pull files into the page cache."""
    for p in paths:
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass


# --- the machine -------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def machine(scratch: Path) -> dict[str, Any]:
    """What the figures were measured on (no paths of the machine)."""
    import mlx_lm

    from ..local.filesystem import filesystem_type

    return {
        "nproc": os.cpu_count(),
        "memory_gib": round(_mem_total() / 2**30, 1),
        "cpu": _cpu_model(),
        "filesystem": filesystem_type(scratch) or "unknown",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", "unknown"),
        "mlx_lm": getattr(mlx_lm, "__version__", "unknown"),
        "mlx_device": str(mx.default_device()),
        "loadavg_at_start": os.getloadavg()[0],  # other work on the machine skews the figures
    }


def chunks(seq: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]
