"""Record what each real client sends, across turns, sessions and a restart, and keep the
request bodies as the adapters' fixtures (``tests/data/agents/<client>-<version>-*.json``).

    python tests/agents/capture.py [OUT_DIR]   # default: tests/data/agents

For each client: session A (a turn that calls a tool, a turn that continues it), session B
(a new session in the same repository, after a commit), the server restarted on the same
root, session A resumed, then resumed again on another day (a time zone whose date is not
today's). Each model request's body is written as
``<client>-<version>-<label>.json`` (``a1-1``: session A, turn 1, first request), with what
is machine-specific or secret-looking normalised (:func:`normalise`), and
``<client>-<version>-usage.json`` lists every request's prompt size and share from the cache.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import clients  # noqa: E402
from agent_model import TOOL_WORD  # noqa: E402
from scenario import CLAUDE, CODEX, OPENCODE, Client, Session, session, usage  # noqa: E402

PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex",
            "opencode": "opencode-ai"}
NAMES = {"claude": "claude-code", "codex": "codex", "opencode": "opencode"}
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_HEX = re.compile(r"\b[0-9a-f]{40,64}\b")


def normalise(text: str, workspace: Path, seen: dict[str, str]) -> str:
    """The workspace's paths as ``/work`` (the client's ``HOME`` is ``/work/home``; the
    user is ``agent``), the kernel's version and the shell as fixed words, ids and long hex
    digests (device ids, commit hashes) as placeholders in order of first appearance
    (``seen``, shared by one client's files: equal ids stay equal across them, different
    ones different)."""
    text = text.replace(str(workspace), "/work")
    text = re.sub(r"(OS Version: )[^\\\n\"]+", r"\1Linux <kernel>", text)
    text = re.sub(r"(<shell>|Shell: )[^<\\\n\"]+", r"\1bash", text)

    def sub(kind: str) -> Any:
        def f(m: re.Match[str]) -> str:
            return seen.setdefault(m.group(0), f"<{kind}-{len(seen) + 1}>")
        return f

    text = _UUID.sub(sub("uuid"), text)
    return _HEX.sub(sub("hex"), text)


def _steps(s: Session, c: Client) -> None:
    one = s.turn(c.first(f"Read the README of this project. {TOOL_WORD}"))
    assert one.run.ok(), one.run
    sid = c.session(one.run)
    assert s.turn(c.again("What does it say?")).run.ok()
    (s.repo / "NOTES.md").write_text("notes\n")
    subprocess.run(["git", "-c", "user.name=agent", "-c", "user.email=agent@example.invalid",
                    "commit", "-qam", "x", "--allow-empty"], cwd=s.repo, check=True,
                   timeout=60)
    assert s.turn(c.first("A new session: list the files.")).run.ok()
    s.restart()
    assert s.turn(c.resume("Back again: thanks.", sid), restarted=True).run.ok()
    # the same session on another day: a time zone whose date is not today's (UTC)
    other = "Etc/GMT+12" if time.gmtime().tm_hour < 12 else "Etc/GMT-14"
    assert s.turn(c.resume("The next day.", sid), env={"TZ": other}).run.ok()


def capture(c: Client, out: Path, bin_dir: Path) -> None:
    version = clients.versions()[PACKAGES[c.name]]
    prefix = f"{NAMES[c.name]}-{version}"
    with tempfile.TemporaryDirectory() as tmp, session(c, Path(tmp), bin_dir) as s:
        _steps(s, c)
        labels = ["a1", "a2", "b1", "a3", "a4"]
        rows = []
        seen: dict[str, str] = {}
        for label, turn in zip(labels, s.turns, strict=True):
            for j, ex in enumerate(turn.model_requests(c.path), 1):
                body = normalise(json.dumps(ex.json(), indent=1, ensure_ascii=False),
                                 Path(tmp), seen)
                name = f"{prefix}-{label}-{j}.json"
                (out / name).write_text(body + "\n")
                prompt, cached = usage(ex)
                rows.append({"request": name, "path": ex.path, "prompt": prompt,
                             "cached": cached, "restarted": turn.restarted,
                             "first_byte_s": round(ex.first_byte or 0, 3),
                             "end_s": round(ex.ended or 0, 3)})
        (out / f"{prefix}-usage.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(f"{prefix}: {len(rows)} requests")


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent / "data" / "agents"
    out.mkdir(parents=True, exist_ok=True)
    where = clients.install()
    for client in (CLAUDE, CODEX, OPENCODE):
        capture(client, out, where)
