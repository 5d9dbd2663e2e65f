"""Issue 12, "the newcomer's path": what a new user meets first, each seen on a fresh clone.

Every test drives the public API or the command line in fresh processes, as a user
would; the command-line details are in ``tests/cli/test_cli_newcomer.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env(root: Path | None = None) -> dict[str, str]:
    """This environment, offline, with ``KVSTORE_ROOT`` set to ``root`` (or unset)."""
    env = dict(os.environ)
    env.pop("KVSTORE_ROOT", None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if root is not None:
        env["KVSTORE_ROOT"] = str(root)
    return env


def _kvstore(*args: str | Path, root: Path, cwd: Path | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvstore ARGS`` in a fresh process (``-P``: the test's cwd shadows nothing)."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "kvstore", *map(str, args), "--root", str(root)],
        capture_output=True, text=True, env=_env(), cwd=cwd, timeout=timeout,
    )


def _json(*args: str | Path, root: Path) -> Any:
    p = _kvstore(*args, "--json", root=root)
    assert p.returncode == 0, p
    return json.loads(p.stdout)


# --- item 2: the README's Python example runs offline ------------------------------------


def readme_python_blocks() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_readme_example_runs_offline_and_its_second_run_hits(tmp_path: Path) -> None:
    """The first Python block of the README, as written, twice: a miss, then a hit."""
    code = readme_python_blocks()[0]
    assert "with Store.open(" in code, "the example closes its store"
    assert "make_tiny_model" in code, "the runnable path comes first"
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    root = tmp_path / "root"
    runs = [subprocess.run([sys.executable, "-P", str(script)], capture_output=True, text=True,
                           env=_env(root), cwd=tmp_path, timeout=300) for _ in range(2)]
    for p in runs:
        assert p.returncode == 0, p.stderr
    first, second = (int(re.search(r"(\d+) of \d+ prompt tokens", p.stdout)[1])  # type: ignore[index]
                     for p in runs)
    assert first == 0 and second > 0
    assert _json("stats", root=root)["hits"] == 1


def test_readme_keeps_the_hub_line_as_the_own_model_variant() -> None:
    blocks = readme_python_blocks()
    assert "mlx-community/" not in blocks[0]
    assert any('load("mlx-community/' in b for b in blocks[1:])


# --- item 3: hits and access stamps are not lost without close() ---------------------------

_NO_CLOSE = textwrap.dedent("""
    import sys, time
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from kvstore import Namespace, Store

    store = Store.open(sys.argv[1], namespace=Namespace(model_id="m"), block_tokens=16)
    tokens = list(range(40))
    cache, n = store.restore(tokens[:-1])
    if cache is None:
        c = KVCache()
        c.update_and_fetch(mx.ones((1, 2, 40, 8)), mx.ones((1, 2, 40, 8)))
        store.save(tokens, [c])
    print("restored", n, flush=True)
    if len(sys.argv) > 2:  # a long-running process: stay, and never close
        time.sleep(float(sys.argv[2]))
""")



def test_stamps_of_processes_that_never_close_the_store_are_kept(tmp_path: Path) -> None:
    """The README snippet without ``with``/``close()``, three times: a miss and two hits."""
    script = tmp_path / "no_close.py"
    script.write_text(_NO_CLOSE, encoding="utf-8")
    root = tmp_path / "root"
    for _ in range(3):
        p = subprocess.run([sys.executable, "-P", str(script), str(root)], capture_output=True,
                           text=True, env=_env(), timeout=120)
        assert p.returncode == 0, p.stderr
    (entry,) = _json("ls", root=root)["entries"]
    assert entry["hits"] == 2
    stats = _json("stats", root=root)
    assert (stats["lookups"], stats["hits"]) == (3, 2)



def test_a_long_running_process_writes_its_stamps_within_a_bounded_delay(tmp_path: Path) -> None:
    script = tmp_path / "no_close.py"
    script.write_text(_NO_CLOSE, encoding="utf-8")
    root = tmp_path / "root"
    p = subprocess.run([sys.executable, "-P", str(script), str(root)], capture_output=True,
                       text=True, env=_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    before = _json("stats", root=root)["lookups"]
    proc = subprocess.Popen([sys.executable, "-P", str(script), str(root), "120"],
                            stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("restored 39")
        deadline = time.monotonic() + 15
        while (stats := _json("stats", root=root))["lookups"] == before:
            assert proc.poll() is None
            assert time.monotonic() < deadline, "the hit was not written while the process ran"
            time.sleep(0.5)
        assert stats["lookups"] == before + 1 and stats["hits"] >= 1
        (entry,) = _json("ls", root=root)["entries"]
        assert entry["hits"] == 1
    finally:
        proc.kill()  # no exit hook runs: what is on disk was written while it ran
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# --- items 4 and 6: the demo, run from a folder that holds a directory named kvstore ----------


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                                 Path]:
    here = tmp_path_factory.mktemp("demo")
    (here / "kvstore").mkdir()  # a checkout's folder, a user's notes: anything of that name
    (here / "kvstore" / "notes.txt").write_text("not the package\n")
    root = here / "root"
    return _kvstore("demo", root=root, cwd=here, timeout=600), root



def test_demo_runs_from_a_folder_holding_a_directory_named_kvstore(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    p, _ = demo_run
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ImportError" not in p.stderr
    assert re.search(r"^2nd process .*reused\s+[1-9]\d* \(disk", p.stdout, re.M), p.stdout



def test_stats_count_the_lookups_and_hits_of_the_demo(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    p, root = demo_run
    from_disk = len(re.findall(r"reused\s+\d+ \(disk", p.stdout))
    assert from_disk >= 1, p.stdout + p.stderr
    stats = _json("stats", root=root)
    assert stats["hits"] == from_disk
    assert stats["lookups"] >= stats["hits"]
    assert stats["hit_rate"] == pytest.approx(stats["hits"] / stats["lookups"])
    text = _kvstore("stats", root=root).stdout
    assert re.search(rf"^store lookups\s+{stats['lookups']} lookups?, {from_disk} loaded an "
                     rf"entry \([\d.]+%\)$", text, re.M), text


def test_stats_report_the_demo_s_reused_tokens_by_tier(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Issue 28: the tokens each tier gave add up to what the demo itself printed."""
    p, root = demo_run
    rows = re.findall(r"prompt\s+(\d+)\s+reused\s+(\d+) \((\w+|-)", p.stdout)
    assert len(rows) == 7, p.stdout
    want = {"memory": 0, "disk": 0, "-": 0}
    for _, reused, source in rows:
        want[source] += int(reused)
    life = _json("stats", root=root)["requests"]["lifetime"]
    assert life["requests"] == 7
    assert life["prompt_tokens"] == sum(int(n) for n, _, _ in rows)
    assert life["tiers"]["memory"]["tokens"] == want["memory"] > 0
    assert life["tiers"]["local"]["tokens"] == want["disk"] > 0
    assert life["tiers"]["remote"] == {"requests": 0, "tokens": 0} and want["-"] == 0
    assert life["reused_tokens"] + life["computed_tokens"] == life["prompt_tokens"]
    assert life["misses"] == sum(1 for _, n, _ in rows if n == "0")
    text = _kvstore("stats", root=root).stdout
    share = life["reused_tokens"] / life["prompt_tokens"]
    assert re.search(rf"^tokens saved\s+{share:.1%} \({life['reused_tokens']:,} of "
                     rf"{life['prompt_tokens']:,} prompt tokens\)$", text, re.M), text


# --- item 5: serve checks its model and its options before it binds a port --------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_error_line(p: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert p.returncode == 2, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("kvstore: error: ") and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]



def test_serve_with_a_missing_model_fails_before_binding_the_port(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    port = _free_port()
    try:
        p = _kvstore("serve", "--model", missing, "--host", "127.0.0.1", "--port", str(port),
                     root=tmp_path / "root", timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("kvstore serve started without a model")
    _one_error_line(p, str(missing))
    assert not (tmp_path / "root").exists()



def test_serve_option_errors_are_one_line(tmp_path: Path) -> None:
    p = _kvstore("serve", "--max-bytes", "banana", root=tmp_path / "root", timeout=60)
    _one_error_line(p, "--max-bytes", "banana")
    p = _kvstore("serve", "--min-tokens", "many", root=tmp_path / "root", timeout=60)
    _one_error_line(p, "--min-tokens", "many")



def test_serve_exit_log_is_a_readable_summary(tmp_path: Path) -> None:
    from kvstore.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    port = _free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "kvstore", "serve", "--root", str(tmp_path / "root"),
             "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "INFO"],
            stdout=out, stderr=subprocess.STDOUT, env=_env(),
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert proc.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.2)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    text = log.read_text()
    assert "PersistStats(" not in text
    summary = [line for line in text.splitlines() if "kvstore: saved " in line]
    assert len(summary) == 1, text
    assert re.search(r"kvstore: saved 0 entries\b.*\bhits\b", summary[0]), summary[0]
