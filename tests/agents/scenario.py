"""One client's session against ``kvstore serve``, as a user has it: a first turn that
calls a tool, a second that continues the session, the server restarted on the same cache
root, a third that resumes it; every request recorded on its way (:mod:`recorder`).

What differs from one client to the next is in :class:`Client`: how a turn is started,
continued and resumed, the tool its model calls, the API it speaks, and where that API
puts the usage figures and a tool's result. Nothing here knows how the server is built: it
is a process started with the README's options, spoken to over HTTP.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import agent_model
import clients
from recorder import Exchange, Recorder

#: The README's text the model reads back through its tool: the proof of a round trip.
MARKER = "kvstore-agents-readme-7f3a91"
#: The share of each request's prompt that must come from the cache from the second turn on.
REUSE = 0.95


@dataclass
class Client:
    """A client's ways (the key of :data:`clients.CLIENTS`, ``name``)."""

    name: str
    path: str  # the API path its model requests use
    tool: str  # the tool the model calls, and its arguments for a file of the repository
    arguments: Callable[[Path], dict[str, Any]]
    first: Callable[[str], list[str]]
    again: Callable[[str], list[str]]
    resume: Callable[[str, str], list[str]]  # (prompt, session id)
    session: Callable[[clients.Run], str]  # the session id a first turn printed


def _claude_session(r: clients.Run) -> str:
    return str(json.loads(r.stdout)["session_id"])


def _codex_session(r: clients.Run) -> str:
    m = re.search(r"^session id: (\S+)$", r.stderr, re.MULTILINE)
    assert m is not None, str(r)
    return m.group(1)


def _opencode_session(r: clients.Run) -> str:
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            sid = json.loads(line).get("sessionID")
            if sid:
                return str(sid)
    raise AssertionError(str(r))


CLAUDE = Client(
    "claude", "/v1/messages", "Read", lambda repo: {"file_path": str(repo / "README.md")},
    first=lambda p: ["claude", "-p", "--output-format", "json", p],
    again=lambda p: ["claude", "-p", "--output-format", "json", "--continue", p],
    resume=lambda p, s: ["claude", "-p", "--output-format", "json", "--resume", s, p],
    session=_claude_session)
CODEX = Client(
    "codex", "/v1/responses", "exec_command", lambda repo: {"cmd": "cat README.md"},
    first=lambda p: ["codex", "exec", p],
    again=lambda p: ["codex", "exec", "resume", "--last", p],
    resume=lambda p, s: ["codex", "exec", "resume", s, p],
    session=_codex_session)
OPENCODE = Client(
    "opencode", "/v1/chat/completions", "read",
    lambda repo: {"filePath": str(repo / "README.md")},
    first=lambda p: ["opencode", "run", "--format", "json", p],
    again=lambda p: ["opencode", "run", "--format", "json", "--continue", p],
    resume=lambda p, s: ["opencode", "run", "--format", "json", "--session", s, p],
    session=_opencode_session)


# --- what a recorded exchange says ------------------------------------------------------


def usage(ex: Exchange) -> tuple[int, int]:
    """``(prompt tokens, of which from the cache)`` from a model request's answer, in its
    API's own usage fields (the last that the stream or the body gives)."""
    found: tuple[int, int] | None = None
    bodies: list[Any] = [data for _, data in ex.events()]
    if not bodies:
        bodies = [json.loads(bytes(ex.answer))]
    for data in bodies:
        if not isinstance(data, dict):
            continue
        u = data.get("usage")
        if data.get("type", "").startswith("response.") and isinstance(data.get("response"),
                                                                       dict):
            u = data["response"].get("usage")
        if not isinstance(u, dict):
            continue
        if "cache_read_input_tokens" in u:  # Anthropic: three parts add up to the prompt
            total = (u.get("input_tokens") or 0) + u["cache_read_input_tokens"] \
                + (u.get("cache_creation_input_tokens") or 0)
            found = (total, u["cache_read_input_tokens"])
        elif "input_tokens_details" in u:  # Responses
            found = (u["input_tokens"], (u["input_tokens_details"] or {}).get(
                "cached_tokens", 0))
        elif "prompt_tokens" in u:  # chat completions
            found = (u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0))
    assert found is not None, f"no usage in the answer to {ex.path}: {bytes(ex.answer)[-500:]!r}"
    return found


def tool_results(ex: Exchange) -> list[str]:
    """The texts of the tool results a request sends back to the model, in any API."""
    body = ex.json() or {}
    out: list[str] = []

    def text(v: Any) -> str:
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            return "".join(text(p.get("text") if isinstance(p, dict) else p) for p in v)
        return ""

    for m in body.get("messages") or []:
        if m.get("role") == "tool":
            out.append(text(m.get("content")))
        for b in m.get("content") if isinstance(m.get("content"), list) else []:
            if isinstance(b, dict) and b.get("type") == "tool_result":
                out.append(text(b.get("content")))
    for item in body.get("input") if isinstance(body.get("input"), list) else []:
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            out.append(text(item.get("output")))
    return out


# --- the session ----------------------------------------------------------------------


class Server:
    """``kvstore serve`` on 127.0.0.1 as a process: the README's options, the model, a root
    (the same one across restarts), its output appended to ``log``."""

    def __init__(self, model: Path, root: Path, log: Path) -> None:
        self.model, self.root, self.log = model, root, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> int:
        from helpers.serving import free_port, wait_healthy

        self.port = free_port()
        argv = [sys.executable, "-m", "kvstore.serve", *clients.serve_options(),
                "--model", str(self.model), "--root", str(self.root),
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "INFO"]
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        wait_healthy(self.proc, self.port, self.log, 120)
        return self.port

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"kvstore serve did not stop\n{self.log.read_text()[-3000:]}"
                                 ) from None
        finally:
            self.proc = None
        assert code in (0, -15), self.log.read_text()[-3000:]


@dataclass
class Turn:
    """A client's turn: its run and the requests it made."""

    run: clients.Run
    exchanges: list[Exchange]
    restarted: bool = False

    def model_requests(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.path.split("?")[0] == path]


@dataclass
class Session:
    """A client's session against a server, turn by turn."""

    client: Client
    workspace: Path
    bin_dir: Path
    server: Server
    recorder: Recorder
    turns: list[Turn] = field(default_factory=list)

    @property
    def repo(self) -> Path:
        return self.workspace / "repo"

    @property
    def home(self) -> Path:
        return self.workspace / "home"

    def env(self) -> dict[str, str]:
        settings = clients.readme_settings(self.client.name,
                                           f"127.0.0.1:{self.recorder.port}")
        return clients.environment(self.home, self.bin_dir, settings, self.recorder.url)

    def turn(self, argv: list[str], *, restarted: bool = False,
             env: dict[str, str] | None = None) -> Turn:
        """Run a turn (``env``: variables to add, such as another ``TZ``)."""
        mark = len(self.recorder.exchanges)
        r = clients.run(argv, cwd=self.repo, env={**self.env(), **(env or {})})
        t = Turn(r, self.recorder.since(mark), restarted)
        self.turns.append(t)
        return t

    def restart(self) -> None:
        self.server.stop()
        self.recorder.retarget(self.server.start())


def make_workspace(d: Path) -> Path:
    """A home and a small git repository (a README that holds :data:`MARKER`)."""
    repo, home = d / "repo", d / "home"
    repo.mkdir(parents=True)
    home.mkdir()
    (repo / "README.md").write_text(f"# demo\n\nA small project. {MARKER}\n")
    (repo / "hello.py").write_text("print('hello')\n")
    git = ["git", "-c", "user.name=agent", "-c", "user.email=agent@example.invalid",
           "-c", "init.defaultBranch=main"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "a small project"]):
        subprocess.run([*git, *cmd], cwd=repo, check=True, capture_output=True, timeout=60)
    return d


@contextmanager
def session(client: Client, d: Path, bin_dir: Path) -> Iterator[Session]:
    """A workspace, the client's model, a server and a recorder in front of it, for the
    block; the server is stopped at its end."""
    make_workspace(d)
    model = agent_model.make_agent_model(d / "model", client.tool,
                                         client.arguments(d / "repo"))
    server = Server(model, d / "root", d / "serve.log")
    port = server.start()
    try:
        with Recorder(port) as rec:
            yield Session(client, d, bin_dir, server, rec)
    finally:
        server.stop()
