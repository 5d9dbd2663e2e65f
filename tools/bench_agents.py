"""Real coding agents through `kvstore serve`, turn by turn, with the store and without it.

For each client (Claude Code, Codex, opencode: the pinned ones of ``tests/agents/``, with
the README's settings) two sessions run side by side, each against its own server on its
own root, turn by turn in alternating order: one with the README's `kvstore serve` options
(the store), one with those and ``--baseline-args``, its client run with
``--baseline-env``, the nearest to no cache (by default: no cache in memory, nothing
persisted, and Claude Code told to send no cache breakpoints, the one thing the server keeps
in memory whatever its options say; ``--max-bytes 0`` alone still finds a reply's snapshot
that waits in memory to be written). A session is a turn that calls a tool (the model asks
for the README, the client reads it and sends it back: two requests), a turn that continues
it, both servers restarted on their roots, and a turn that resumes the session by its id.

The model is the scripted agent model of ``tests/agents/agent_model.py`` at ``--shape``
(default ``2x64x2x1``: 2 layers, hidden 64, 2 heads of 32, 1 KV head), whose answers are
the same at every size and whose prefill costs what its shape does: on a 2-core x86 CPU
45-75 s for 30k tokens, a few hundred tokens a second. (The tests' one-layer shape
prefills 30k tokens in a tenth of a second: MLX computes no attention for it.)

Per request, from the recording proxy in front of each server: the time to the event
that carries the first token (not a ``ping`` or a keepalive sent during the prefill) and
to the answer's end; from the answer's usage fields: the prompt's tokens and those read
from the cache; from the server's request log, where it can be read (``kvstore request
… source=…``): which tier they came from. Per turn: the client's whole run.

Usage: python tools/bench_agents.py [--clients claude codex opencode] [--shape 2x64x2x1]
       [--baseline-args '--prompt-cache-size 0 --min-tokens 100000000']
       [--baseline-env DISABLE_PROMPT_CACHING=1] [--json FILE] [--keep DIR]
       python tools/bench_agents.py --from-json FILE    # an earlier run's tables again
       python tools/bench_agents.py --prefill 30720 [--shape S]   # a shape's prefill alone

Prints a Markdown table per client (and the load average before and after each turn).
Needs Node.js and npm (the clients are installed into their cache on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "agents"), str(HERE.parent / "tests")]

import agent_model  # noqa: E402
import clients  # noqa: E402
from helpers.serving import free_port, wait_healthy  # noqa: E402
from recorder import Exchange, Recorder  # noqa: E402
from scenario import CLAUDE, CODEX, OPENCODE, Client, make_workspace, usage  # noqa: E402

CLIENTS = {c.name: c for c in (CLAUDE, CODEX, OPENCODE)}
DEFAULT_SHAPE = "2x64x2x1"
#: No cache in memory, nothing persisted (no prompt is that long); Claude Code's breakpoints
#: off (a breakpoint's cache is pinned in memory, one at least, whatever the LRU's size).
DEFAULT_BASELINE = "--prompt-cache-size 0 --min-tokens 100000000"
DEFAULT_BASELINE_ENV = "DISABLE_PROMPT_CACHING=1"
TURN_TIMEOUT = 1800.0  # seconds a client's turn may take (a no-cache one prefills it all)
ARMS = ("store", "none")  # with the store; the baseline

#: Events that come before the model's first token (a prefill's keepalives included).
_PREAMBLE = {"message_start", "ping", "response.created", "response.in_progress"}


# --- one request ---------------------------------------------------------------------


def _blocks(answer: bytes) -> list[tuple[int, str | None, Any]]:
    """A streamed answer's server-sent events: ``(offset of the byte that completes it,
    event name, data)``; comments (``: keepalive``) are not events."""
    out: list[tuple[int, str | None, Any]] = []
    pos = 0
    for m in re.finditer(rb"\r?\n\r?\n", answer):
        block, pos_next = answer[pos:m.start()], m.end()
        name, data = None, []
        for line in block.splitlines():
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data.append(line[5:].strip())
        if data and data != [b"[DONE]"]:
            try:
                value: Any = json.loads(b"\n".join(data))
            except ValueError:
                value = None
            out.append((m.end() - 1, name, value))
        pos = pos_next
    return out


def _is_output(name: str | None, data: Any) -> bool:
    """Whether an event carries what the model generated."""
    if not isinstance(data, dict):
        return False
    kind = name or data.get("type")
    if kind in _PREAMBLE:
        return False
    if kind is not None and kind != "chat.completion.chunk" and "choices" not in data:
        return True  # Anthropic's and the Responses API's events after the preamble
    for choice in data.get("choices") or []:  # chat completions: a chunk with a delta
        delta = choice.get("delta") or {}
        if any(delta.get(k) for k in ("content", "tool_calls", "reasoning",
                                      "reasoning_content")) or choice.get("finish_reason"):
            return True
    return False


def first_token(ex: Exchange) -> float | None:
    """Seconds from the request to the event that carried the model's first token (for an
    answer that is not streamed: its end)."""
    events = _blocks(bytes(ex.answer))
    if not events:
        return ex.ended
    for end, name, data in events:
        if _is_output(name, data):
            return ex.arrived(end)
    return ex.ended


_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def request_lines(text: str) -> list[dict[str, str]]:
    """The ``kvstore request …`` lines of a server's log, as fields."""
    return [{k: v.strip('"') for k, v in _FIELD.findall(line.split("kvstore request ", 1)[1])}
            for line in text.splitlines() if "kvstore request " in line]


@dataclass
class Request:
    """One model request of a turn."""

    prompt: int
    cached: int
    source: str  # the tier the cached tokens came from (the request log), or "-"
    first_token_s: float | None
    end_s: float | None
    status: int


@dataclass
class Turn:
    """One turn of a session: the client's run and its model requests."""

    label: str
    wall_s: float
    ok: bool
    requests: list[Request] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before, after


# --- a session against one server ----------------------------------------------------


class Arm:
    """A client's session against its own `kvstore serve` (the README's options, then
    ``extra``), with a recorder in front of it."""

    def __init__(self, client: Client, d: Path, bin_dir: Path, shape: agent_model.Shape,
                 extra: list[str], env: dict[str, str]) -> None:
        self.client, self.d, self.bin_dir, self.extra = client, d, bin_dir, extra
        self.env = env  # added to the client's environment
        make_workspace(d)
        self.model = agent_model.make_agent_model(d / "model", client.tool,
                                                  client.arguments(d / "repo"), shape)
        self.log = d / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.recorder = Recorder(self.start(), timeout=TURN_TIMEOUT)
        self.turns: list[Turn] = []
        self.session_id = ""

    def start(self) -> int:
        port = free_port()
        argv = [sys.executable, "-m", "kvstore", "serve", *clients.serve_options(),
                *self.extra, "--model", str(self.model), "--root", str(self.d / "root"),
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "INFO"]
        with self.log.open("a") as out:
            out.write(f"$ {shlex.join(argv)}\n")
            out.flush()
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        wait_healthy(self.proc, port, self.log, 300)
        return port

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.recorder.retarget(self.start())

    def close(self) -> None:
        self.stop()
        self.recorder.close()

    def turn(self, label: str, argv: list[str]) -> Turn:
        settings = clients.readme_settings(self.client.name,
                                           f"127.0.0.1:{self.recorder.port}")
        env = {**clients.environment(self.d / "home", self.bin_dir, settings,
                                     self.recorder.url), **self.env}
        mark, logged = len(self.recorder.exchanges), self.log.stat().st_size
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        run = clients.run(argv, cwd=self.d / "repo", env=env, timeout=TURN_TIMEOUT)
        wall = time.monotonic() - t0
        if not self.session_id and run.ok():
            self.session_id = self.client.session(run)
        time.sleep(1.0)  # the request log's last line is written as the reply is stored
        with self.log.open("rb") as f:
            f.seek(logged)
            lines = request_lines(f.read().decode("utf-8", "replace"))
        exchanges = [e for e in self.recorder.since(mark)
                     if e.path.split("?")[0] == self.client.path]
        with (self.d / "events.jsonl").open("a") as f:  # what the figures were read from
            for i, ex in enumerate(exchanges, 1):
                (self.d / f"request-{label}-{i}.json").write_bytes(ex.body)
                f.write(json.dumps({"turn": label, "path": ex.path, "status": ex.status,
                                    "first_byte": ex.first_byte, "ended": ex.ended,
                                    "events": [(name or (data.get("type") if isinstance(
                                                data, dict) else None), ex.arrived(end))
                                               for end, name, data in _blocks(
                                                   bytes(ex.answer))]}) + "\n")
        t = Turn(label, wall, run.ok(), load=(load, os.getloadavg()[0]))
        for ex in exchanges:
            if ex.status != 200:
                t.requests.append(Request(0, 0, "-", None, ex.ended, ex.status))
                continue
            prompt, cached = usage(ex)
            # its log line: the next one of its prompt's size (the lines come in order)
            at = next((j for j, line in enumerate(lines) if line.get("prompt") == str(prompt)),
                      None)
            source = lines[at].get("source", "-") if at is not None else "-"
            lines = lines[at + 1:] if at is not None else lines
            t.requests.append(Request(prompt, cached, source, first_token(ex), ex.ended,
                                      ex.status))
        if not run.ok():
            print(f"bench_agents: {self.client.name} ({self.d.name}) turn {label} failed:\n"
                  f"{run}", file=sys.stderr)
        self.turns.append(t)
        return t


def run_client(client: Client, d: Path, bin_dir: Path, shape: agent_model.Shape,
               baseline: list[str], baseline_env: dict[str, str]) -> dict[str, list[Turn]]:
    """The two sessions of one client, interleaved turn by turn (the order alternating)."""
    # workspaces named alike (``a``, ``b``), so both sessions' prompts are the same size
    arms = {ARMS[0]: Arm(client, d / "a", bin_dir, shape, [], {}),
            ARMS[1]: Arm(client, d / "b", bin_dir, shape, baseline, baseline_env)}
    order = list(ARMS)
    try:
        steps: list[tuple[str, Any]] = [
            ("1", lambda a: client.first(f"Read the README of this project. "
                                         f"{agent_model.TOOL_WORD}")),
            ("2", lambda a: client.again("What does it say?")),
            ("restart", None),
            ("3", lambda a: client.resume("Thanks, that is all.", a.session_id)),
        ]
        for label, argv in steps:
            if argv is None:
                for a in arms.values():
                    a.restart()
                continue
            for name in order:
                a = arms[name]
                t = a.turn(label, argv(a))
                print(f"  {client.name} {name:>5} turn {label}: {t.wall_s:6.1f} s, "
                      f"{len(t.requests)} requests, load {t.load[0]:.1f} -> {t.load[1]:.1f}",
                      file=sys.stderr, flush=True)
            order.reverse()
    finally:
        for a in arms.values():
            a.close()
    return {name: a.turns for name, a in arms.items()}


# --- the table -----------------------------------------------------------------------

_LABELS = {"1": "1, calls a tool", "2": "2, continues", "3": "3, restarted, resumes"}


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _cached(r: Request) -> str:
    share = r.cached / r.prompt if r.prompt else 0.0
    where = f", {r.source}" if r.source not in ("-", "none") else ""
    return f"{r.cached:,} ({share:.1%}{where})"


def table(turns: dict[str, list[Turn]]) -> str:
    """One client's turns as a Markdown table: per request, the store's figures and the
    baseline's side by side; per turn, the client's whole run."""
    rows = ["| turn | request | prompt tokens | from the cache: store | none | first token: "
            "store | none | turn's end: store | none |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for ts, tn in zip(turns[ARMS[0]], turns[ARMS[1]], strict=True):
        failed = [arm for arm, x in zip(ARMS, (ts, tn), strict=True) if not x.ok]
        label = _LABELS.get(ts.label, ts.label) + (
            f" (the client failed: {', '.join(failed)})" if failed else "")
        n = max(len(ts.requests), len(tn.requests))
        for i in range(n):
            rs = ts.requests[i] if i < len(ts.requests) else None
            rn = tn.requests[i] if i < len(tn.requests) else None
            last = i == n - 1
            prompt = "/".join(sorted({f"{r.prompt:,}" for r in (rs, rn) if r is not None}))
            rows.append(
                f"| {label if i == 0 else ''} | {i + 1} | {prompt} | "
                f"{_cached(rs) if rs else '-'} | {_cached(rn) if rn else '-'} | "
                f"{_s(rs.first_token_s) if rs else '-'} | "
                f"{_s(rn.first_token_s) if rn else '-'} | "
                f"{_s(ts.wall_s) if last else ''} | {_s(tn.wall_s) if last else ''} |")
    ws = sum(t.wall_s for t in turns[ARMS[0]])
    wn = sum(t.wall_s for t in turns[ARMS[1]])
    rows.append(f"| all turns | | | | | | | {_s(ws)} | {_s(wn)} |")
    return "\n".join(rows)


def turns_of(report: dict[str, Any]) -> dict[str, list[Turn]]:
    """A client's turns as ``--json`` wrote them (``report["clients"][name]``)."""
    out: dict[str, list[Turn]] = {}
    for arm, turns in report.items():
        out[arm] = [Turn(t["label"], t["wall_s"], t["ok"],
                         [Request(**r) for r in t["requests"]], tuple(t["load"]))
                    for t in turns]
    return out


def tables(report: dict[str, Any]) -> str:
    """The whole run's tables, each under its client's name."""
    head = (f"Model: {agent_model.Shape(**report['shape'])}. Baseline: "
            f"`{report['baseline']}`. Load average {report['load_start'][0]:.2f} at the "
            f"start, {report['load_end'][0]:.2f} at the end.\n")
    return "\n".join([head, *(f"### {clients.CLIENTS[name]}\n\n{table(turns_of(turns))}\n"
                              for name, turns in report["clients"].items())])


def prefill_rate(shape: agent_model.Shape, tokens: int, d: Path) -> dict[str, Any]:
    """What a prefill of ``tokens`` costs the model at ``shape``, in this process, as
    mlx-lm's generation runs it (chunks of 2048 that evaluate the cache, then the last
    token's logits): seconds, and tokens a second."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    from kvstore.tiny import sample_text

    model_dir = agent_model.make_agent_model(d / "model", "Read", {"file_path": "x"}, shape)
    model, tok = mlx_lm.load(str(model_dir))
    text = tok.encode(sample_text(2000, seed=5))
    prompt = mx.array((text * (tokens // len(text) + 1))[:tokens])
    t0 = time.perf_counter()
    for _ in generate_step(prompt, model, max_tokens=1, prefill_step_size=2048):
        break
    seconds = time.perf_counter() - t0
    return {"shape": str(shape), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds), "load": os.getloadavg()[0]}


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                       text=True, timeout=30)
    return r.stdout.strip() or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", nargs="+", choices=list(CLIENTS),
                    default=["claude", "codex", "opencode"])
    ap.add_argument("--shape", default=DEFAULT_SHAPE,
                    help="the model's LAYERSxHIDDENxHEADSxKV_HEADS[xINTERMEDIATE] "
                         f"(default {DEFAULT_SHAPE})")
    ap.add_argument("--baseline-args", default=DEFAULT_BASELINE,
                    help=f"`kvstore serve` options of the run without the store, after the "
                         f"README's (default {DEFAULT_BASELINE!r})")
    ap.add_argument("--baseline-env", nargs="*", default=[DEFAULT_BASELINE_ENV],
                    metavar="NAME=VALUE", help="variables added to the environment of the "
                    f"baseline's clients (default {DEFAULT_BASELINE_ENV})")
    ap.add_argument("--json", type=Path, help="write every figure to this file")
    ap.add_argument("--keep", type=Path, help="work in this directory and keep it (the "
                    "workspaces, the servers' logs and roots); default: a temporary one")
    ap.add_argument("--from-json", type=Path, metavar="FILE",
                    help="run nothing: print the tables of an earlier run's --json FILE")
    ap.add_argument("--prefill", type=int, metavar="TOKENS",
                    help="run no client: time a prefill of TOKENS tokens at --shape, in "
                         "this process, and print it")
    a = ap.parse_args()
    if a.from_json is not None:
        print(tables(json.loads(a.from_json.read_text())))
        return
    shape = agent_model.Shape.parse(a.shape)
    if a.prefill is not None:
        with tempfile.TemporaryDirectory(prefix="bench-agents-") as tmp:
            print(json.dumps(prefill_rate(shape, a.prefill, Path(tmp))))
        return
    baseline = shlex.split(a.baseline_args)
    baseline_env = dict(v.split("=", 1) for v in a.baseline_env)
    said = " ".join([*(f"{k}={v}" for k, v in baseline_env.items()), shlex.join(baseline)])
    bin_dir = clients.install()
    report: dict[str, Any] = {
        "shape": asdict(shape), "baseline_args": baseline, "baseline_env": baseline_env,
        "baseline": said, "serve_options": clients.serve_options(),
        "versions": clients.versions(), "commit": _commit(), "cpus": os.cpu_count(),
        "load_start": os.getloadavg(), "clients": {}}
    print(f"bench_agents: model {shape}; baseline: {said}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-agents-") as tmp:
        base = a.keep if a.keep is not None else Path(tmp)
        for name in a.clients:
            d = base / name
            d.mkdir(parents=True, exist_ok=False)
            turns = run_client(CLIENTS[name], d, bin_dir, shape, baseline, baseline_env)
            report["clients"][name] = {arm: [asdict(t) for t in ts]
                                       for arm, ts in turns.items()}
    report["load_end"] = os.getloadavg()
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=1) + "\n")
    print(tables(report))


if __name__ == "__main__":
    main()
