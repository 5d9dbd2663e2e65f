"""``kvstore serve``: mlx-lm's HTTP server with the persistent prompt cache."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.server
import pytest

from kvstore.serve import parse_size, serve_main
from kvstore.server.main import AUTO_LANES, prefill_threads
from kvstore.tiny import make_tiny_model, sample_text


def test_parse_size() -> None:
    assert parse_size("1024") == 1024
    assert parse_size("512M") == 512 << 20
    assert parse_size("2GB") == 2 << 30
    assert parse_size("1.5KiB") == 1536


def test_help_lists_both_option_sets_and_touches_no_root(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTORE_ROOT", str(tmp_path / "root"))
    original = mlx_lm.server.LRUPromptCache
    assert serve_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--min-tokens" in out and "--root" in out  # ours
    assert "--prompt-cache-size" in out and "--model" in out  # mlx-lm's
    assert mlx_lm.server.LRUPromptCache is original
    assert not (tmp_path / "root").exists()


def served_cache(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> Any:
    """The prompt cache that ``kvstore serve ARGV --prompt-cache-size 3`` builds, with the
    model's load and the server itself left out (the model directory is one only by its
    ``config.json``: nothing loads it)."""
    import kvstore.server.main as main

    built: list[Any] = []
    model = Path(_root_of(argv)).parent / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(main, "load_model", lambda asked, path, a: None)
    monkeypatch.setattr(main, "serve", lambda a, loaded, store, cache, *rest: built.append(cache))
    assert serve_main([*argv, "--model", str(model), "--prompt-cache-size", "3"]) == 0
    (cache,) = built
    return cache


def _root_of(argv: list[str]) -> str:
    return argv[argv.index("--root") + 1]


@pytest.mark.parametrize(
    ("flag", "reuse", "verify"),
    [([], True, True), (["--no-reuse-prefix"], False, True), (["--no-verify-reads"], True, False)],
)
def test_server_prompt_cache_is_ours_with_the_options_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: list[str], reuse: bool, verify: bool
) -> None:
    from kvstore.mlx_lm import PersistentPromptCache

    argv = ["--root", str(tmp_path / "r"), "--min-tokens", "32", "--namespace", "ns", *flag,
            "--port", "0"]  # the listen check binds it: any free port
    cache = served_cache(monkeypatch, argv)
    assert isinstance(cache, PersistentPromptCache)
    assert (cache.reuse_prefix, cache.min_tokens, cache.ns, cache.max_size) == (reuse, 32, "ns", 3)
    assert cache.store.verify_reads is verify


@pytest.mark.parametrize(("flag", "want"), [([], 300.0), (["--defer-seconds", "0"], 0.0),
                                           (["--defer-seconds=2.5"], 2.5)])
def test_defer_seconds_reaches_every_prompt_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: list[str], want: float
) -> None:
    cache = served_cache(monkeypatch, ["--root", str(tmp_path / "r"), *flag])
    assert cache.defer_seconds == want and cache._writer.defer_seconds == want


@pytest.mark.parametrize("bad", ["-1", "nan"])
def test_a_negative_defer_seconds_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    assert serve_main(["--root", str(tmp_path / "r"), "--defer-seconds", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvstore: error: --defer-seconds must be >= 0, got {float(bad):g}"]
    assert not (tmp_path / "r").exists()


def test_a_bad_prefill_threads_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve_main(["--root", str(tmp_path / "r"), "--prefill-threads", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvstore: error: --prefill-threads must be >= 1, got 0"]
    assert not (tmp_path / "r").exists()


def test_prefill_threads_default_to_the_cpus_cores_up_to_4() -> None:
    assert mx.default_device() == mx.cpu  # these tests run MLX on the CPU
    assert prefill_threads(None) == min(AUTO_LANES, len(os.sched_getaffinity(0))) == min(
        4, len(os.sched_getaffinity(0)))
    assert prefill_threads(3) == 3


@pytest.mark.parametrize(("bad", "why"), [("-1", "must be >= 0, got -1.0"),
                                          ("nan", "must be >= 0, got nan"),
                                          ("inf", "must be finite, got inf")])
def test_a_bad_prefill_step_time_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str, why: str
) -> None:
    assert serve_main(["--root", str(tmp_path / "r"), "--prefill-step-time", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvstore: error: --prefill-step-time {why}"]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("flag", "want"), [([], 1.5), (["--remote-deadline", "0.25"], 0.25)])
def test_remote_deadline_reaches_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: list[str], want: float
) -> None:
    cache = served_cache(monkeypatch, ["--root", str(tmp_path / "r"), *flag])
    assert cache.store.tiers.deadline == want


@pytest.mark.parametrize("bad", ["0", "-1", "nan"])
def test_a_bad_remote_deadline_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    assert serve_main(["--root", str(tmp_path / "r"), "--remote-deadline", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvstore: error: --remote-deadline must be > 0, got {float(bad):g}"]
    assert not (tmp_path / "r").exists()


def test_bad_mlx_lm_option_is_a_usage_error(tmp_path: Path) -> None:
    original = mlx_lm.server.LRUPromptCache
    assert serve_main(["--root", str(tmp_path / "r"), "--port", "not-a-port"]) == 2
    assert mlx_lm.server.LRUPromptCache is original


# --- end to end over HTTP --------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _server(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[int]:
    port = _free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*args, "--host", "127.0.0.1", "--port", str(port), "--log-level", "INFO"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except (urllib.error.URLError, ConnectionError):
                    assert proc.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.2)
            yield port
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode in (0, -signal.SIGTERM), log.read_text()


def _chat(port: int, system: str, user: str) -> dict[str, Any]:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 16,
        "temperature": 0.0,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return dict(json.loads(r.read()))


@pytest.mark.slow
def test_second_server_reuses_the_first_ones_cache(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", "llama")
    root = tmp_path / "root"
    ours = [
        sys.executable,
        "-m",
        "kvstore.serve",
        "--model",
        str(model),
        "--root",
        str(root),
        "--min-tokens",
        "16",
    ]
    system = sample_text(500, seed=3)

    with _server(ours, tmp_path / "a.log") as port:
        first = _chat(port, system, "Which planet is closest to the sun?")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    log = (tmp_path / "a.log").read_text()
    assert re.search(r"kvstore: saved [1-9]\d* entr(y|ies) \(.* 1 miss$", log, re.M), log

    question = "What is the capital of France?"
    with _server(ours, tmp_path / "b.log") as port:  # cold process, same root
        second = _chat(port, system, question)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 500 < cached < second["usage"]["prompt_tokens"]

    plain = [
        sys.executable,
        "-m",
        "mlx_lm",
        "server",
        "--model",
        str(model),
        "--prompt-cache-size",
        "0",
    ]
    with _server(plain, tmp_path / "c.log") as port:
        baseline = _chat(port, system, question)
    assert baseline["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["choices"][0]["message"] == baseline["choices"][0]["message"]
    assert second["usage"]["completion_tokens"] == baseline["usage"]["completion_tokens"]


# --- issue 27, items 2-4: a port it cannot bind, a model by name, GET /v1/models ------------


def _serve_cmd(*args: str | Path, env: dict[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "KVSTORE_ROOT"}
    full.update(HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-P", "-m", "kvstore", "serve", *map(str, args)],
                          capture_output=True, text=True, env=full, timeout=timeout)


def _one_line(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 2, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: error: "), p.stderr
    return lines[0]


def test_a_port_in_use_is_one_line_and_exit_2_before_anything_starts(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", "llama")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        p = _serve_cmd("--model", model, "--root", tmp_path / "root", "--host", "127.0.0.1",
                       "--port", str(port))
    assert time.monotonic() - t0 < 30
    assert _one_line(p) == (f"kvstore: error: cannot listen on 127.0.0.1:{port}: "
                            "Address already in use")
    assert not (tmp_path / "root").exists()


def test_a_port_out_of_range_is_one_line_and_exit_2(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", "llama")
    p = _serve_cmd("--model", model, "--root", tmp_path / "root", "--port", "80933")
    assert _one_line(p) == "kvstore: error: --port 80933: not a port number (0 to 65535)"
    assert not (tmp_path / "root").exists()


def test_a_port_taken_after_the_check_stops_mlx_lms_thread_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The race the check cannot close: the model loaded meanwhile, nothing else is left
    running, so the process exits instead of waiting on it."""
    import threading

    import kvstore.server.main as serve

    model = make_tiny_model(tmp_path / "model", "llama")
    monkeypatch.setattr(serve, "check_listen", lambda host, port: None)
    before = set(threading.enumerate())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = serve_main(["--root", str(tmp_path / "root"), "--model", str(model),
                           "--host", "127.0.0.1", "--port", str(port)])
    assert code == 2
    assert f"kvstore: error: cannot serve on 127.0.0.1:{port}: Address already in use" in (
        capsys.readouterr().err)
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] == []
    assert mlx_lm.server._run_http_server.__module__ == "mlx_lm.server"


@pytest.fixture(scope="module")
def served_by_name(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, Path]]:
    """``kvstore serve --model smollm2`` where smollm2 is already in the model cache (a tiny
    model stands in for it), with no Hugging Face cache at all."""
    from kvstore.mlx_lm.gguf import MODELS

    tmp = tmp_path_factory.mktemp("by-name")
    models = tmp / "models"
    served = make_tiny_model(models / MODELS["smollm2"].dirname, "llama")
    (served / ".kvstore-converted").write_text("{}\n")
    hf = tmp / "hf-home"
    hf.mkdir()
    env = {"KVSTORE_MODELS": str(models), "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-P", "-m", "kvstore", "serve", "--model", "smollm2",
            "--root", str(tmp / "root"), "--min-tokens", "16"]
    with _server(args, tmp / "serve.log", env=env) as port:
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               timeout=60, max_retries=0)
        yield client, served, tmp / "serve.log"


def test_serve_accepts_a_model_name_that_model_fetch_knows(
    served_by_name: tuple[Any, Path, Path],
) -> None:
    client, served, log = served_by_name
    r = client.chat.completions.create(model="default_model", max_tokens=4, temperature=0.0,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert r.usage is not None and r.usage.completion_tokens >= 1
    assert "kvstore: --model smollm2: " in log.read_text()
    assert str(served) in log.read_text()


def test_get_models_answers_the_served_model_without_a_hub_cache(
    served_by_name: tuple[Any, Path, Path],
) -> None:
    client, served, _ = served_by_name
    assert [m.id for m in client.models.list().data] == ["smollm2"]  # issue 38: a short id
    # and a client that takes the model from the list can chat with it
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2-135M-Instruct-Q4_1-bf16-mlx", "absolute"])
def test_the_served_model_answers_to_its_name_its_directory_and_its_path(
    served_by_name: tuple[Any, Path, Path], name: str,
) -> None:
    """Issue 38, item 13: the name it was started with, its directory's name and its path
    are all the served model (mlx-lm took each for a hub id: 404, ConnectError)."""
    from kvstore.mlx_lm.gguf import MODELS

    client, served, log = served_by_name
    assert served.name == MODELS["smollm2"].dirname
    model = str(served.resolve()) if name == "absolute" else name
    r = client.chat.completions.create(model=model, max_tokens=2, temperature=0.0,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert r.usage is not None and r.usage.completion_tokens >= 1
    assert "Fetching" not in log.read_text() and "ConnectError" not in log.read_text()
