"""``kvstore serve`` starting and stopping (issue 38, items 4, 6 and 12): what it needs
before it binds, what it says it serves, and what a client streaming an answer hears when
the server stops under it. Real processes on 127.0.0.1, the ``openai`` SDK as the client,
a tiny random-weight model; every process bounded in time."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helpers.serving import free_port, wait_healthy

from kvstore.tiny import make_tiny_model, sample_text


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTORE_ROOT", "KVSTORE_MODELS")}
    (tmp / "hf-home").mkdir(exist_ok=True)
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp / "hf-home"),
               KVSTORE_MODELS=str(tmp / "models"))
    return env


def _serve(tmp: Path, *args: str | Path, timeout: float = 120
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "kvstore", "serve", *map(str, args)],
                          capture_output=True, text=True, env=_env(tmp), timeout=timeout)


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# --- item 6: an unknown option is one line, before any model is fetched -------------------


def test_an_unknown_option_is_one_line_before_any_model_is_fetched(tmp_path: Path) -> None:
    p = _serve(tmp_path, "--model", "smollm2", "--bogus-flag", "--root", tmp_path / "root")
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == ("kvstore: error: unrecognized arguments: --bogus-flag "
                        "(see 'kvstore serve --help')\n")
    assert not (tmp_path / "models").exists() and not (tmp_path / "root").exists()


def test_a_bad_value_of_an_mlx_lm_option_is_one_line(tmp_path: Path) -> None:
    p = _serve(tmp_path, "--model", "smollm2", "--max-tokens", "many")
    assert p.returncode == 2
    assert p.stderr == ("kvstore: error: argument --max-tokens: invalid int value: 'many' "
                        "(see 'kvstore serve --help')\n")
    assert not (tmp_path / "models").exists()


# --- item 4: no model, a hub id it cannot have, a model that does not load ----------------


def test_no_model_is_one_line_and_exit_2(tmp_path: Path) -> None:
    port = free_port()
    p = _serve(tmp_path, "--root", tmp_path / "root", "--port", port)
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == ("kvstore: error: no model to serve: give --model DIR, a Hugging Face "
                        "repo id or smollm2 (see 'kvstore serve --help')\n")
    assert not (tmp_path / "root").exists()


@pytest.mark.slow
def test_a_hub_id_neither_cached_nor_downloadable_is_one_line_before_binding(
    tmp_path: Path,
) -> None:
    port = free_port()
    t0 = time.monotonic()
    p = _serve(tmp_path, "--model", "nobody/no-such-model", "--root", tmp_path / "root",
               "--host", "127.0.0.1", "--port", port)
    assert time.monotonic() - t0 < 60
    assert (p.returncode, p.stdout) == (2, ""), p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("kvstore: error: --model nobody/no-such-model: cannot load it: "
                               "LocalEntryNotFoundError: "), p.stderr
    assert _port_is_free(port)


@pytest.mark.slow
def test_a_model_directory_that_does_not_load_is_one_line_before_binding(
    tmp_path: Path,
) -> None:
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    port = free_port()
    p = _serve(tmp_path, "--model", model, "--root", tmp_path / "root",
               "--host", "127.0.0.1", "--port", port)
    assert (p.returncode, p.stdout) == (2, ""), p.stderr
    assert p.stderr == (f"kvstore: error: --model {model}: cannot load it: "
                        f"FileNotFoundError: No safetensors found in {model}\n")
    assert _port_is_free(port)


# --- item 12: what it says at start and at a stop; a stream cut by the stop ---------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama")


@pytest.fixture
def server(tmp_path: Path, tiny: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "kvstore", "serve", "--model", str(tiny),
             "--root", str(tmp_path / "root"), "--min-tokens", "16",
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, text=True, env=_env(tmp_path))
        try:
            wait_healthy(proc, port, log, 120)
            yield proc, port, log
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(60)


@pytest.mark.slow
def test_serve_says_what_it_serves_and_that_it_drains(
    server: tuple[subprocess.Popen[str], int, Path], tmp_path: Path, tiny: Path,
) -> None:
    proc, port, log = server
    start = [line for line in log.read_text().splitlines() if line.startswith("kvstore: ")]
    assert start == [f"kvstore: serving tiny-llama ({tiny}) on http://127.0.0.1:{port}, cache "
                     f"root {tmp_path / 'root'}, no checkpoints (this model's cache can be "
                     "trimmed)",
                     # the tiny model's ChatML template prints no tools
                     "kvstore: this model's template renders no tools: agents that call tools "
                     "will not work with it (requests with tools get a 400; --drop-tools "
                     "accepts them and drops the tools)"]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           timeout=60, max_retries=0)
    r = client.chat.completions.create(
        model="tiny-llama", max_tokens=2, temperature=0.0,
        messages=[{"role": "user", "content": sample_text(60)}])
    assert r.usage is not None and r.usage.prompt_tokens > 16
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    lines = [line for line in log.read_text().splitlines() if line.startswith("kvstore: ")]
    root = tmp_path / "root"
    # the request's prompt and its reply, deferred (--defer-seconds): written at the stop
    assert lines[2:] == [
        "kvstore: SIGTERM: stopping: ending the requests in flight, then writing the "
        "snapshots still queued",
        f"kvstore: stopped serving; writing 1 queued snapshot to {root}",
    ]


@pytest.mark.slow
def test_a_stream_cut_by_a_stop_ends_in_an_error_the_client_sees(
    server: tuple[subprocess.Popen[str], int, Path],
) -> None:
    """mlx-lm ended such a stream as if the answer were complete (no finish reason, no
    usage): the openai SDK returned normally. Now the stream's last event is an error,
    which the SDK raises."""
    proc, port, log = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           timeout=60, max_retries=0)
    stream = client.chat.completions.create(
        model="tiny-llama", max_tokens=100_000, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Tell me a long story."}])
    chunks = 0
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            chunks += 1
            assert chunk.usage is None and chunk.choices[0].finish_reason is None
            if chunks == 3:
                proc.send_signal(signal.SIGTERM)
            assert chunks < 50_000
    assert err.value.message == ("generation stopped before the answer was complete: the "
                                 "server is shutting down")
    assert proc.wait(60) == 0
    assert re.search(r"ERROR - kvstore: generation stopped before the answer was complete",
                     log.read_text())


@pytest.mark.slow
def test_a_hub_id_in_the_local_hugging_face_cache_is_served_and_listed_by_it(
    tmp_path: Path, tiny: Path,
) -> None:
    """Offline, a repo id the Hugging Face cache holds loads before the port is bound, and
    is the id ``/v1/models`` lists (mlx-lm's own scan passed it over) and a request uses."""
    import shutil

    repo = tmp_path / "hf-home" / "hub" / "models--someone--tiny-llama"
    shutil.copytree(tiny, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "kvstore", "serve", "--model", "someone/tiny-llama",
             "--root", str(tmp_path / "root"), "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, text=True, env=_env(tmp_path))
        try:
            wait_healthy(proc, port, log, 120)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                   timeout=60, max_retries=0)
            assert [m.id for m in client.models.list().data] == ["someone/tiny-llama"]
            r = client.chat.completions.create(model="someone/tiny-llama", max_tokens=2,
                                               messages=[{"role": "user", "content": "Hi"}])
            assert r.usage is not None and r.usage.completion_tokens >= 1
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
    assert (f"kvstore: serving someone/tiny-llama on http://127.0.0.1:{port}, cache root "
            f"{tmp_path / 'root'}, no checkpoints (this model's cache can be trimmed)"
            ) in log.read_text().splitlines()


@pytest.mark.slow
def test_an_answer_cut_by_a_stop_before_it_was_sent_is_a_500(
    server: tuple[subprocess.Popen[str], int, Path],
) -> None:
    """Not streamed: mlx-lm had chosen 200 and sent nothing yet; the client now gets a 500
    naming the cause instead of a dropped connection."""
    import threading

    proc, port, log = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           timeout=60, max_retries=0)
    got: list[BaseException] = []

    def ask() -> None:
        try:
            client.chat.completions.create(
                model="tiny-llama", max_tokens=100_000, temperature=0.0,
                messages=[{"role": "user", "content": "Tell me a long story."}])
        except BaseException as e:  # noqa: BLE001 - what the client saw is the point
            got.append(e)

    t = threading.Thread(target=ask)
    t.start()
    deadline = time.monotonic() + 60
    while "Prompt processing progress" not in log.read_text():  # it is generating
        assert time.monotonic() < deadline and t.is_alive(), log.read_text()
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert proc.wait(60) == 0
    (e,) = got
    assert isinstance(e, openai.InternalServerError), repr(e)
    assert e.status_code == 500
    assert e.message == ("Error code: 500 - generation stopped before the answer was "
                         "complete: the server is shutting down")
