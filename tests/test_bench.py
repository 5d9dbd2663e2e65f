"""The benchmark runs end to end in its smoke size and writes every row (never a timing check)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from kvstore.bench import GROUPS, main

# Row names (prefixes) every run of every group must produce.
EXPECTED = (
    "save 600 durable",
    "save 600 non-durable",
    "part of the 600 non-durable save: BLAKE3 of every block, alone",
    "part of the 600 non-durable save: writing every block, alone",
    "restore 600 page cache",
    "restore 600 after eviction",
    "restore 600 page cache, verify_reads=False",
    "restore 600 after eviction, verify_reads=False",
    "multi-turn total save time",
    "multi-turn bytes written",
    "multi-turn bytes written vs unique KV bytes",
    "shared system prompt: bytes on disk",
    "lookup p50, 10 entries",
    "lookup p99, 10 entries",
    "lookup p50, 30 entries",
    "lookup p99, 30 entries",
    "time to first token, 300 tokens",
    "shared document, question 2: cached tokens (llama,",
    "shared document, question 2: cached tokens (lfm2,",
    "shared document, question 2: time to first token (gemma3_text,",
    "bytes on disk per checkpoint (lfm2,",
    "bytes on disk per checkpoint (gemma3_text,",
    "root after question 1: bytes on disk (lfm2,",
    "restore throughput, 1 process",
    "restore throughput, 2 process",
    "limit: save 600 durable",
    "limit: save 600 non-durable",
    "limit: restore 600 page cache, verify_reads=False: Store.restore alone",
    "limit: restore 600 page cache: Store.restore alone",
    "limit: restore 600 after eviction, verify_reads=False: Store.restore alone",
    "limit: lookup 30 entries, 2048 token query",
    "limit: lookup 30 entries, 2048 token query, with its keys",
    "startup: import kvstore + Store.open",
    "startup: kvstore stats",
)


@pytest.mark.slow  # 45 s: every case of the bench at its smoke sizes
def test_smoke_run_writes_every_row_with_both_figures(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_REMOTE", raising=False)
    out = tmp_path / "bench.json"
    assert main(["--config", "smoke", "--json", str(out), "--scratch", str(tmp_path)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    names = [r["name"] for r in rows]
    for want in EXPECTED:
        assert any(n.startswith(want) for n in names), f"no row {want!r} in {names}"
    # the remote group needs a gateway (tests/remote/test_remote_bench.py runs it), the gpu
    # group a GPU (without one it says so in a line and adds no rows)
    assert {r["group"] for r in rows} == (set(GROUPS) - {"remote", "gpu"}) | {"limit"}
    for r in rows:
        for key in ("kvstore", "baseline", "ratio"):
            assert isinstance(r[key], float | int) and math.isfinite(r[key]), (r["name"], key)
        assert r["kvstore"] > 0 and r["baseline"] > 0, r["name"]
        assert r["baseline_label"] and r["unit"]
    assert doc["machine"]["nproc"] >= 1 and doc["targets"]
    held = {t["name"] for t in doc["targets"]}
    assert not any("part of the" in t for t in held), "the parts are not saves"
    limits = [t for t in doc["targets"] if t["name"].startswith("machine limit: ")]
    assert limits and all(t["want"] == ">= 0.8x of the limit" for t in limits)
    # the lookup is held to its gets alone; the row with its keys only helps read that ratio
    assert any(t["name"].endswith("limit: lookup 30 entries, 2048 token query") for t in limits)
    assert not any(t["name"].endswith("with its keys") for t in limits)
    lookup = next(r for r in rows if r["name"] == "limit: lookup 30 entries, 2048 token query")
    assert lookup["extra"]["gets"] >= 1
    assert math.isclose(lookup["ratio"], lookup["baseline"] / lookup["kvstore"])
    assert any(t.startswith("save speed: save 600 non-durable") for t in held)
    # issue 26: cached tokens and bytes per checkpoint are counts, not timings: held here
    ckpt = [t for t in doc["targets"] if t["name"].startswith("checkpoints: ")]
    assert len(ckpt) == 5 and all(t["met"] for t in ckpt), ckpt
    assert not any(r["name"].startswith("bytes on disk per checkpoint (llama") for r in rows)
    assert list(tmp_path.iterdir()) == [out], "the scratch roots were not removed"


def test_unknown_group_is_an_error() -> None:
    assert main(["--config", "smoke", "--only", "nope"]) == 2


def test_multiturn_targets_hold_only_at_the_issue_size() -> None:
    from kvstore.bench.common import Row
    from kvstore.bench.report import targets

    def rows(turns: float, tokens: float, speedup: float, extra_bytes: float) -> list[Row]:
        size = {"turns": turns, "turn_tokens": tokens}
        return [
            Row("multiturn", "multi-turn total save time, reuse_prefix=True (x)", "s",
                1.0, speedup, "b", "speedup", extra=size),
            Row("multiturn", "multi-turn total save time (x)", "s",
                1.0, 2.0, "b", "speedup", extra=size),
            Row("multiturn", "multi-turn bytes written vs unique KV bytes", "B",
                extra_bytes, 1.0, "b", "fraction", extra=size),
        ]

    def met(rs: list[Row]) -> list[bool | None]:
        return [t.met for t in targets(rs) if t.name.startswith("multi-turn")]

    assert met(rows(16, 2000, 5.5, 1.05)) == [True, True]  # the plain save is not held
    assert met(rows(16, 2000, 4.9, 1.2)) == [False, False]
    assert met(rows(8, 1000, 3.0, 1.2)) == [None, None]  # --quick: reported, not judged


def test_verified_restore_is_held_to_load_prompt_cache_in_both_places() -> None:
    from kvstore.bench.common import Row
    from kvstore.bench.report import targets

    def row(name: str, verified: bool) -> Row:
        return Row("restore", name, "s", 1.0, 0.95, "b", "speedup", extra={"verified": verified})

    got = {t.name: (t.want, t.met) for t in targets([
        row("restore 4k page cache", True),
        row("restore 4k page cache, verify_reads=False", False),
        row("restore 4k after eviction", True),
        row("restore 4k after eviction, verify_reads=False", False),
    ])}
    assert got["restore from page cache: restore 4k page cache"] == (">= 1.0x", False)
    assert got["restore from page cache: restore 4k page cache, verify_reads=False"] == (
        ">= 1.0x", False)
    assert got["restore after eviction: restore 4k after eviction"] == (">= 1.0x", False)
    assert got["restore after eviction: restore 4k after eviction, verify_reads=False"] == (
        ">= 0.9x", True)


def test_the_model_group_runs_only_with_a_model(tmp_path: Path) -> None:
    from kvstore.bench.cli import MODEL_GROUP

    assert MODEL_GROUP not in GROUPS  # the default run never loads a real model
    assert main(["--config", "smoke", "--only", "model"]) == 2
    assert main(["--config", "smoke", "--only", "model", "--model", str(tmp_path)]) == 2


def test_model_targets_wait_for_the_issue_size() -> None:
    from kvstore.bench.common import Row
    from kvstore.bench.report import targets

    def ttft(tokens: float, ratio: float) -> Row:
        return Row("model", f"time to first token, {tokens:.0f} tokens, restore from page "
                   "cache (m)", "s", 1.0, ratio, "prefill", "speedup", extra={"tokens": tokens})

    shares = {f"store_turn{i}_share": s for i, s in enumerate((0.0, 0.9, 0.85, 0.9), 1)}
    talk = Row("model", "4-turn conversation, prompt processing, store (cold memory each "
               "turn) vs no cache (m)", "s", 1.0, 3.0, "none", "speedup",
               extra={"turns": 4.0, **shares})
    got = {t.name: t.met for t in targets([ttft(4096, 30), ttft(256, 5), talk])}
    assert got["real model: time to first token, 4096 tokens, restore from page cache (m)"]
    assert got["real model: time to first token, 256 tokens, restore from page cache (m)"] is None
    assert got["real model: cached share of turns 2..4, store"] is True
    talk.extra["store_turn3_share"] = 0.5
    got = {t.name: t.met for t in targets([talk])}
    assert got["real model: cached share of turns 2..4, store"] is False


# --- issue 27, item 12: one label, one figure per case, a reason for every n/a -----------------


def test_quick_targets_say_why_they_are_not_judged_and_name_limits_once() -> None:
    from kvstore.bench.common import Row
    from kvstore.bench.limits import limit_row
    from kvstore.bench.report import targets, targets_table

    size = {"turns": 8.0, "turn_tokens": 1000.0}
    rows = [
        Row("multiturn", "multi-turn total save time, reuse_prefix=True (x)", "s", 1.0, 3.0,
            "b", "speedup", extra=size),
        Row("multiturn", "multi-turn bytes written vs unique KV bytes", "B", 1.2, 1.0, "b",
            "fraction", extra=size),
        Row("lookup", "lookup p99, 10k entries", "s", 1e-3, 1e-2, "b", "speedup",
            extra={"entries": 10_000}),
        limit_row("limit: save 4k durable", 1.0, 0.9, "raw"),
    ]
    ts = targets(rows)
    assert "machine limit: save 4k durable" in {t.name for t in ts}
    assert not any("limit: limit:" in t.name for t in ts)
    undecided = [t for t in ts if t.met is None]
    assert len(undecided) == 4  # save speed (no row), the two multi-turn ones, 100k lookup
    assert all(t.why for t in undecided), undecided
    table = targets_table(ts)
    assert "| n/a |" not in table
    assert ("n/a: held at 16 turns of 2000 tokens; this run has 8 of 1000 (the full config "
            "measures it)") in table
    assert "n/a: this run stops at 10000 entries (the full config goes to 100k)" in table


def test_each_restore_case_is_measured_once(tmp_path: Path) -> None:
    """The limit rows take the Store.restore share of the restore rows' own runs: never a
    second, different figure for the same case."""
    from kvstore.bench.cli import run
    from kvstore.bench.common import SMOKE

    rows = run(SMOKE, tmp_path, ("restore",), log=lambda line: None)
    by_name = {r.name: r for r in rows}
    limits = [r for r in rows if r.group == "limit" and r.part_of]
    assert len(limits) == 3
    # issue 37: the same entry restored again and again in one process, and in a fresh one
    assert [r.name for r in rows if r.group == "limit" and not r.part_of] == [
        "limit: restore 600 page cache, repeated in one process",
        "limit: restore 600 page cache, repeated in one process, against arrays all held",
        "limit: restore 600 page cache, in a fresh process",
        "limit: restore 600 page cache, in a fresh process: first touch of its pages alone"]
    for r in limits:
        whole = by_name[r.part_of]  # the restore row whose runs it is a part of
        assert r.name == f"limit: {whole.name}: Store.restore alone"
        assert 0 < r.kvstore <= whole.kvstore
        assert r.extra["decode_s"] == pytest.approx(whole.kvstore - r.kvstore)
    assert {r.part_of for r in limits} == {"restore 600 page cache",
                                          "restore 600 page cache, verify_reads=False",
                                          "restore 600 after eviction, verify_reads=False"}


def _normal(name: str) -> str:
    """A row name with its sizes and counts as N, and a model's name (the last parenthesis
    without a space) left out: the doc's full run and a smoke run name rows alike."""
    name = re.sub(r" \([^ ()]+\)$", "", name)
    return re.sub(r"\d+(\.\d+)?k?", "N", name)


@pytest.mark.slow  # 45 s: it runs the bench to learn its row names
def test_benchmarks_md_tables_use_the_benchs_own_row_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27, item 11: every row of a table in the bench's own format in
    docs/BENCHMARKS.md is a name the bench prints (sizes aside)."""
    import dataclasses

    import kvstore.bench.startup_cases as startup
    from kvstore.bench.cli import GROUPS, MODEL_GROUP, run
    from kvstore.bench.common import FULL, SMOKE
    from kvstore.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny-model", "llama")
    groups = tuple(g for g in GROUPS if g != "remote") + (MODEL_GROUP,)
    # the startup group's names, for every command, without timing fresh processes
    monkeypatch.setattr(startup, "_opened", lambda root, before: 0.1)
    monkeypatch.setattr(startup, "_command", lambda args, before: 0.2)
    cfg = dataclasses.replace(SMOKE, startup_commands=FULL.startup_commands)
    rows = run(cfg, tmp_path, groups, log=lambda line: None, model_dir=model)
    known = {_normal(r.name) for r in rows}
    text = (Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md").read_text()
    header = "| case | kvstore | baseline | ratio | baseline is |"
    names = []
    for table in text.split(header)[1:]:
        for line in table.splitlines()[2:]:
            if not line.startswith("|"):
                break
            names.append(line.split("|")[1].strip())
    assert len(names) >= 30
    unknown = [n for n in names if _normal(n) not in known]
    assert unknown == [], unknown


def test_startup_children_use_cached_bytecode_as_an_install_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``PYTHONDONTWRITEBYTECODE`` in the caller's environment made every startup run
    compile kvstore from source (150 ms where an install pays 80): the children get
    neither it nor the caller's root."""
    import kvstore.bench.startup_cases as startup

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("KVSTORE_ROOT", "/nonexistent")
    env = startup._env()
    assert "PYTHONDONTWRITEBYTECODE" not in env and "KVSTORE_ROOT" not in env
    assert env["PATH"] == os.environ["PATH"]


# --- issue 38, item 2: a worker that dies is an error at once, not a 600 s wait -------------


def test_a_dead_worker_is_an_error_at_once_naming_its_exit() -> None:
    """A spawned worker that exits without its result (it died importing kvstore in a clone
    named kvstore) once left the bench waiting 600 s on Queue.get; the worker still alive
    beside it (waiting at the barrier for the dead one) is stopped."""
    import multiprocessing as mp
    import time

    from kvstore.bench.concurrency import WorkerDiedError, gather

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = [ctx.Process(target=os._exit, args=(3,)), ctx.Process(target=time.sleep, args=(60,))]
    for p in ps:
        p.start()
    t = time.monotonic()
    with pytest.raises(WorkerDiedError) as e:
        gather(out, ps, "a kv restore worker", timeout=60)
    assert str(e.value) == ("a kv restore worker died before sending its result "
                            "(exit code 3; its error is above)")
    assert time.monotonic() - t < 15
    assert [p.exitcode for p in ps] == [3, -15]


def test_a_worker_that_exits_cleanly_without_a_result_is_an_error() -> None:
    import multiprocessing as mp

    from kvstore.bench.concurrency import WorkerDiedError, gather

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=os._exit, args=(0,))
    p.start()
    with pytest.raises(WorkerDiedError, match=r"^a ml restore worker exited \(exit code 0\) "
                                              r"without sending its result$"):
        gather(out, [p], "a ml restore worker", timeout=60, grace=0.5)


# --- issue 38, item 3: the write-cost serve runs with -P and a failed one keeps its log ------


def test_a_serve_that_does_not_start_keeps_its_log_outside_the_scratch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the folder that holds a clone named kvstore (``-P`` keeps it off sys.path),
    a serve that fails keeps its log where the error says, after the scratch is gone."""
    import shutil
    import tempfile

    from kvstore.bench.write_cost import serve_chat

    holder = tmp_path / "src"
    holder.mkdir()
    (holder / "kvstore").symlink_to(Path(__file__).resolve().parents[1], target_is_directory=True)
    monkeypatch.chdir(holder)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(RuntimeError) as e:
        serve_chat(tmp_path / "no-model", scratch / "root", [], "system",
                   ("hi",), 1, scratch / "deferred.log")
    m = re.fullmatch(r"kvstore serve did not start \(exit code 2\); its log: (\S+)", str(e.value))
    assert m, str(e.value)
    shutil.rmtree(scratch)
    kept = Path(m[1])
    assert kept.parent == tmp_path and kept.name.startswith("kvstore-bench-serve-")
    text = kept.read_text()
    assert text == f"kvstore: error: --model {tmp_path / 'no-model'}: no such model directory\n"


# --- issue 38, item 16: a group not asked for is "not run", not "not measured" ---------------


def test_a_target_of_a_group_not_asked_for_says_not_run() -> None:
    from kvstore.bench.report import Target, targets, targets_table

    ts = targets([])
    assert ts[0] == Target("save speed", ">= 0.9x", "not run", None,
                           "the save group was not run (--only left it out)")
    assert "| save speed | >= 0.9x | not run | n/a: the save group was not run (--only left it " \
           "out) |" in targets_table(ts)
    assert "not measured" not in targets_table(ts)

# --- issue 37: time to first token on a GPU -------------------------------------------------


def test_the_gpu_group_says_in_one_line_why_it_is_skipped(tmp_path: Path) -> None:
    import mlx.core as mx

    from kvstore.bench.cli import run
    from kvstore.bench.common import SMOKE

    if mx.is_available(mx.gpu):
        pytest.skip(reason="only on a machine whose MLX has no GPU (this one has one)")
    lines: list[str] = []
    assert run(SMOKE, tmp_path, ("gpu",), log=lines.append) == []
    assert len(lines) == 1 and lines[0].startswith("[gpu] skipped: MLX "), lines
    assert "has no GPU here" in lines[0] and "mlx-cuda-13" in lines[0]


def test_the_gpu_case_runs_on_a_tiny_shape_and_gets_the_prefills_token(tmp_path: Path) -> None:
    """The case as the GPU runs it, on a tiny llama shape and on whatever device MLX has:
    every restore must give the prefill's first token, or it raises."""
    import dataclasses

    from kvstore.bench.common import SMOKE
    from kvstore.bench.gpu_cases import TINY, gpu_rows

    cfg = dataclasses.replace(SMOKE, gpu_sizes=(300,), gpu_reps=1)
    rows = gpu_rows(cfg, tmp_path, lambda line: None, shape=TINY, force=True)
    assert [r.name.split(" (")[0] for r in rows] == [
        "GPU time to first token, 300 tokens, page cache",
        "GPU time to first token, 300 tokens, page cache",
        "GPU time to first token, 300 tokens, after eviction",
        "GPU time to first token, 300 tokens, after eviction"]
    assert all(r.kvstore > 0 and r.baseline > 0 for r in rows)
    assert list(tmp_path.iterdir()) == []


# --- issue 43: kvstore serve against mlx_lm.server, over HTTP ---------------------------------


def test_keepalives_say_how_much_of_the_long_prompt_is_done() -> None:
    from kvstore.bench.serve_cases import _Progress

    p = _Progress()
    assert p.wait_for(0.5, 0.01)  # nothing yet: waited out, the prefill still runs
    p.update(b": keepalive 2048/8192")
    p.update(b": a comment of another shape")
    assert p.fraction == 0.25
    p.update(b": keepalive 1024/8192")  # never backwards
    assert p.fraction == 0.25
    p.update(None)  # the first token: the prefill has ended
    assert not p.wait_for(0.5, 5.0)


def test_the_subagents_computed_tokens_come_from_the_request_lines_after_the_mark(
        tmp_path: Path) -> None:
    from kvstore.bench.serve_cases import computed, request_log_computed

    log = tmp_path / "serve.log"
    log.write_text("kvstore request id=1 model=m prompt=900 reused=0 computed=900\n")
    mark = log.stat().st_size
    with log.open("a") as f:
        f.write("INFO other line computed=5\n"
                "kvstore request id=2 model=m prompt=910 reused=0 source=none computed=910\n"
                "kvstore request id=3 model=m prompt=911 reused=880 computed=31 restore_ms=1\n")
    assert request_log_computed(log, mark, 2) == [910, 31]
    assert request_log_computed(log, mark, 3, wait=0.3) == [910, 31]  # waited, bounded
    assert computed({"prompt_tokens": 911, "prompt_tokens_details": {"cached_tokens": 880}}) == 31
    assert computed({"prompt_tokens": 911}) is None  # not reported is not 0 cached


@pytest.mark.slow
def test_the_serve_group_drives_both_servers_on_the_tiny_model(tmp_path: Path) -> None:
    """``--only serve --quick``: both servers started, measured and stopped; each figure
    from what the servers said (usage, the request log), nothing judged by time."""
    from kvstore.bench.serve_cases import SERVE_QUICK

    out = tmp_path / "serve.json"
    assert main(["--quick", "--only", "serve", "--json", str(out), "--scratch",
                 str(tmp_path)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["group"] for r in rows} == {"serve"}
    size = SERVE_QUICK
    tput = [r for r in rows if r["name"].startswith("serve: output tokens/s")]
    assert [r["extra"]["clients"] for r in tput] == list(size.clients)
    for r in tput:
        # the tiny model's answers run to max_tokens: every turn of every session counted
        n = r["extra"]["clients"] * size.turns * size.max_tokens
        assert r["extra"]["kvstore_tokens"] == r["extra"]["baseline_tokens"] == n, r
        assert r["kvstore"] > 0 and r["baseline"] > 0
    p50, p95 = (next(r for r in rows if r["name"].startswith(f"serve: time to first token {q}"))
                for q in ("p50", "p95"))
    for r in (p50, p95):
        assert 1 <= r["extra"]["kvstore_samples"] <= size.short_requests, r
        assert 1 <= r["extra"]["baseline_samples"] <= size.short_requests, r
        assert r["extra"]["long_prompt_tokens"] >= size.long_prompt
    assert p95["kvstore"] >= p50["kvstore"] > 0 and p95["baseline"] >= p50["baseline"] > 0
    (sub,) = [r for r in rows if "subagents at once" in r["name"]]
    e = sub["extra"]
    assert size.prefix <= e["prefix_tokens"] < size.prefix + 20  # the template's header
    assert e["prompt_tokens"] > size.subagents * e["prefix_tokens"]
    # kvstore's request log and its answers' usage agree on what was computed; each server
    # computed the prefix at least once and no more than every prompt in full
    assert e["kvstore_computed_log"] == e["kvstore_computed_usage"]
    for c in (e["kvstore_computed_log"], e["baseline_computed_usage"]):
        assert e["prefix_tokens"] <= c <= e["prompt_tokens"]
    assert sub["kvstore"] == e["kvstore_computed_log"] / e["prefix_tokens"]
    assert 1 < e["floor"] < 1.1  # each subagent's own message, beyond the prefix
    assert list(tmp_path.iterdir()) == [out], "the scratch was not removed"


def test_the_serve_targets_are_issue_43s() -> None:
    from kvstore.bench.common import Row
    from kvstore.bench.report import targets

    rows = [Row("serve", "serve: output tokens/s, 4 concurrent session(s) (tiny)", "tok/s",
                900.0, 1000.0, "mlx_lm.server", "throughput", extra={"target_min_ratio": 1.0}),
            Row("serve", "serve: output tokens/s, 8 concurrent session(s) (tiny)", "tok/s",
                1000.0, 1000.0, "mlx_lm.server", "throughput", extra={"target_min_ratio": 1.0}),
            Row("serve", "serve: 4 subagents (tiny)", "x", 1.1, 4.0, "mlx_lm.server",
                "fraction", extra={"target_max": 1.1, "target_prefix": 20000,
                                   "prefix_tokens": 20016, "floor": 1.01}),
            Row("serve", "serve: 4 subagents (SmolLM2)", "x", 1.29, 1.32, "mlx_lm.server",
                "fraction", extra={"target_max": 1.1, "target_prefix": 20000,
                                   "prefix_tokens": 266, "floor": 1.25}),
            Row("serve", "serve: time to first token p50 (tiny)", "s", 0.5, 2.0,
                "mlx_lm.server", "speedup")]
    got = {t.name: (t.want, t.got, t.met) for t in targets(rows)
           if t.name.startswith("serve:")}
    assert got == {
        "serve: output tokens/s, 4 concurrent session(s) (tiny)":
            (">= 1.0x of mlx_lm.server", "0.90x", False),
        "serve: output tokens/s, 8 concurrent session(s) (tiny)":
            (">= 1.0x of mlx_lm.server", "1.00x", True),
        "serve: 4 subagents (tiny), kvstore serve": ("<= 1.1x of the prefix", "1.10x", True),
        "serve: 4 subagents (SmolLM2), kvstore serve": ("<= 1.1x of the prefix", "1.29x", None),
    }  # the time to first token is reported, not held
    (why,) = [t.why for t in targets(rows) if t.name.startswith("serve: 4 subagents (Smol")]
    assert why == ("held at a 20000-token prefix; this one has 266 (about the least a server "
                   "computes here: 1.25x)")


def test_the_kvstore_side_after_mlx_lms_finds_its_memory_warm(tmp_path: Path) -> None:
    """mlx-lm's side gives kvstore's warm memory back (as in a process of its own); the
    kvstore side timed next must find it again, as every other kvstore side does, or the
    one that always follows mlx-lm's (``verify_reads=False``) alone pays fresh pages."""
    import mlx.core as mx

    from kvstore.bench.common import QUICK, make_cache
    from kvstore.bench.io_cases import SavedPair
    from kvstore.codecs import warm

    # 64 MiB: more than MLX's own cache limit (32 MiB), which kvstore raises only above it
    pair = SavedPair(tmp_path, 1024, make_cache(QUICK, 1024))
    try:
        pair.kv_restore()
        pair.kv_restore()
        assert warm.POLICY.state.raised_to > 0
        pair.mlx_restore()
        assert warm.POLICY.state.raised_to > 0
        assert mx.get_cache_memory() >= pair.bytes
    finally:
        pair.remove()
        warm.POLICY.give_back()


def test_a_fresh_limit_array_held_is_new_memory_and_one_freed_is_not(tmp_path: Path) -> None:
    """Issue 44, item 5: why the strict limit is faster than any restore. An array freed
    after its file comes back at the same address for a later file (glibc's heap: the
    same memory, warm in the caches); with ``hold`` each file has its own, as a
    restore's arrays do. The bytes read are the files' either way."""
    import numpy as np

    from kvstore.bench.limits import RawRead

    blocks = tmp_path / "blocks" / "ab"
    blocks.mkdir(parents=True)
    data = [bytes([i]) * (4 << 20) for i in range(1, 9)]
    for i, d in enumerate(data):
        (blocks / f"{i:064x}").write_bytes(d)
    seen: dict[bool, list[int]] = {False: [], True: []}
    real_empty = np.empty
    for hold in (False, True):
        raw = RawRead(tmp_path, threads=1, fresh=True, hold=hold)

        def empty(n: int, dtype: object, hold: bool = hold) -> np.ndarray:
            a = real_empty(n, dtype)
            seen[hold].append(a.ctypes.data)
            return a

        np.empty = empty  # type: ignore[assignment]
        try:
            held = raw._job(list(range(len(raw.paths))), True)
        finally:
            np.empty = real_empty  # type: ignore[assignment]
        assert len(held) == (8 if hold else 0)
        assert sorted(bytes(v) for v in held) == (data if hold else [])
    # freed: the eight files go through one or two blocks of memory; held: eight arrays
    assert len(set(seen[False])) <= 3 and len(set(seen[True])) == 8
