"""``kvstore demo`` runs offline and its second process reuses the first one's cache."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvstore
from kvstore.demo import run_demo


def test_demo_reuses_across_processes(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    assert run_demo(root) == 0
    out = capfd.readouterr().out
    rows = [line for line in out.splitlines() if "reused" in line]
    assert len(rows) == 7
    reused = [int(m.group(1)) for m in (re.search(r"reused\s+(\d+)", r) for r in rows) if m]
    assert reused[0] == 0 and all(n > 1000 for n in reused[1:])
    second = rows[-1]
    assert second.startswith("2nd process") and "(disk" in second
    with kvstore.Store.open(root) as store:
        stats = store.stats()
    assert stats.entries == 7 and stats.dedup_ratio > 2


def test_demo_quiet_prints_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert run_demo(tmp_path / "root", quiet=True) == 0
    assert capfd.readouterr().out == ""


# --- issue 27, item 7: the demo says which model and why, claims nothing it did not measure,
# explains its dedup, stops at the end of turn and stops cleanly on Ctrl-C ----------------------


def _fake_fetched_smollm2(models: Path) -> Path:
    """A model cache in which smollm2 looks fetched (a tiny model stands in for it)."""
    from kvstore.mlx_lm.gguf import MODELS
    from kvstore.tiny import make_tiny_model

    d = make_tiny_model(models / MODELS["smollm2"].dirname, "llama")
    (d / ".kvstore-converted").write_text("{}\n")
    return d


def test_the_demo_runs_the_tiny_model_and_says_so_even_when_smollm2_is_fetched(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path / "models"))
    _fake_fetched_smollm2(tmp_path / "models")
    assert run_demo(tmp_path / "root") == 0
    lines = capfd.readouterr().out.splitlines()
    assert lines[0].startswith("model: a tiny random-weight llama, built on the spot (the "
                               "default: nothing is downloaded and it takes seconds")
    assert "smollm2 is already fetched: 'kvstore demo --model smollm2' runs it" in lines[0]
    assert not any("smollm2" in line for line in lines[1:])


def test_only_rows_that_reused_something_show_a_speedup(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert run_demo(tmp_path / "root") == 0
    rows = [line for line in capfd.readouterr().out.splitlines() if " reused " in line]
    assert len(rows) == 7
    for row in rows:
        reused = int(re.search(r"reused\s+(\d+)", row)[1])  # type: ignore[index]
        if reused == 0:
            assert "(nothing reused: this is the cold time)" in row and "ms, x" not in row, row
        else:
            assert re.search(r"\(cold\s+[\d.]+ ms, x\s*[\d.]+\)", row), row
    assert "nothing reused" in rows[0]


def test_the_demo_explains_its_dedup_in_whole_blocks() -> None:
    from kvstore.demo import _shared_line

    system = list(range(179))
    short = [system + [1000 + i, 7] for i in range(3)]
    assert _shared_line(short, 256, 1.0) == (
        "the sessions share their first 179 tokens (system prompt and template), less than "
        "one block of 256: no block is shared, so nothing is deduplicated (a shared prompt of "
        "a block or more is)")
    long = [list(range(600)) + [1000 + i] for i in range(3)]
    assert _shared_line(long, 256, 1.8) == (
        "the sessions share their first 600 tokens (system prompt and template): 2 whole "
        "blocks of 256 tokens, stored once for every entry that starts with them (dedup x1.80)")


def test_a_reply_stops_at_the_models_end_of_turn(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore.demo import _Chat
    from kvstore.tiny import make_tiny_model, sample_text

    model = make_tiny_model(tmp_path / "model", "llama")
    with kvstore.Store.open(tmp_path / "root") as store:
        chat = _Chat(model, store)
        prompt = chat.tokens([{"role": "user", "content": sample_text(120, seed=5)}])
        greedy = [int(t) for t, _ in generate_step(
            mx.array(prompt), chat.model, prompt_cache=make_prompt_cache(chat.model),
            max_tokens=6)]
        stop = next(i for i in range(1, 6) if greedy[i] not in greedy[:i])
        chat.eos = {greedy[stop]}  # this model's end of turn comes at reply token `stop`
        r = chat.request(prompt)
        chat.cache.close()
        (entry,) = store.entries()
    assert r["ended"] and r["reply"] == chat.tokenizer.decode(greedy[:stop])
    assert entry.n_tokens == len(prompt) + stop + 1  # the cache holds the end-of-turn token


@pytest.mark.parametrize("when", ["first process", "second process"])
def test_ctrl_c_stops_both_processes_with_one_line(tmp_path: Path, when: str) -> None:
    """The terminal's SIGINT goes to the whole foreground process group."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = tmp_path / "root"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # a terminal's Ctrl-C: SIGINT at its default in the demo, even when this test runs under
    # a shell that started it in the background (which ignores SIGINT, and an ignored
    # signal stays ignored across exec: Python would then install no handler for it)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "kvstore", "demo", "--root", str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        wanted = "session 1 turn 1" if when == "first process" else "starting a second"
        for line in proc.stdout:
            if line.startswith(wanted):
                break
        time.sleep(1.0)  # into the next request, or the child's imports
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "kvstore: interrupted", err
    deadline = time.monotonic() + 10
    while any(str(root) in p.read_text(errors="replace")
              for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists()):
        assert time.monotonic() < deadline, "the second process outlived the demo"
        time.sleep(0.2)
    with kvstore.Store.open(root) as store:
        assert store.verify().sound
